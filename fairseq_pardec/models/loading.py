"""Whether fairseq is rebuilding a model from a checkpoint (rather than building a new one).

Options such as ``--init-from-transformer`` / ``--init-from-verifier`` initialise a *new* model
from another checkpoint at training time; when the trained model itself is loaded (generate,
resume) every weight comes from its own checkpoint and the other file need not exist.
``translation_pardec``'s ``build_model`` sets the flag around fairseq's model construction.
"""

import threading


class _LoadingCheckpoint(threading.local):
    active = False


LOADING_CHECKPOINT = _LoadingCheckpoint()
