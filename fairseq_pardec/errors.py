"""One-line user errors.

fairseq prints a traceback for any exception raised while it builds a generator. A
``UsageError`` is a ``SystemExit`` carrying a message: the CLIs print the one line and exit with
status 1, and library callers can still catch it.
"""


class UsageError(SystemExit):
    def __init__(self, message: str):
        super().__init__("fairseq_pardec: error: " + message)
        self.message = message

    def __str__(self):
        return self.message
