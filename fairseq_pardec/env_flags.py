"""Yes/no environment variables, read one way: ``0/1/false/true/no/yes/off/on`` in any case,
surrounding spaces ignored; unset or empty means the default (``VAR= command`` is how a shell
unsets one for a command). Anything else is refused with one line naming the variable: a typo
that silently meant "on" would leave a switch that looks off but is not.
"""

import os

from fairseq_pardec.errors import UsageError

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")
SPELLINGS = "/".join(value for pair in zip(FALSE, TRUE) for value in pair)


def flag(name: str, default: bool) -> bool:
    """``$name`` as a yes/no value; ``default`` where it is unset or empty."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in TRUE:
        return True
    if value in FALSE:
        return False
    raise UsageError("%s=%s is not a yes/no value; set it to one of %s (any case), or unset it"
                     % (name, os.environ[name].strip(), SPELLINGS))
