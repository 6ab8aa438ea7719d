"""Which decoder step decodes a model: one choice per decoder, device and dtype.

* the static step (cuda/static.py) on CUDA: fixed shapes, recorded as CUDA graphs;
* the fast step (cpu/fast.py) in float32 on the CPU: native kernels, a static cache;
* the lean step (step/lean.py) elsewhere: fairseq's operations in fairseq's order;
* fairseq's own modules (step/block_decoder.py) for layers the lean step does not reproduce.

Every step declares how it rounds (step/margins.py): the static and fast steps round otherwise
than fairseq everywhere; the lean step (on CUDA, or with the model's own output layer) and the
modules round as fairseq does only one position per row, since a block multiplies matrices of
other shapes. The engine's guard decides the close calls wherever a margin applies.

The choice rests on the model's device and dtype, which may change after a generator was built
(fairseq builds the ``--eval-bleu`` generator before it moves the model to the GPU or to
float16; a library user may call ``.cuda()`` or ``.half()`` at any time): :class:`StepChoice`
makes it again per batch, and keeps the step while they stay, so that a steady run builds
nothing.
"""

import logging
import threading
from typing import Callable, NamedTuple, Optional, Tuple

from fairseq_pardec.decoding.cpu.fast import FastBlockDecoder, fast_supported
from fairseq_pardec.decoding.cpu.fast_encoder import FastEncoder, fast_encoder_supported
from fairseq_pardec.decoding.cuda.static import StaticBlockDecoder, static_supported
from fairseq_pardec.decoding.step.block_decoder import BlockDecoder, check_supported_decoder
from fairseq_pardec.decoding.step.interface import DecoderStep
from fairseq_pardec.decoding.step.lean import LeanBlockDecoder, lean_supported

logger = logging.getLogger(__name__)
_fallbacks_logged = set()


def _on_cuda(decoder) -> bool:
    return decoder.embed_tokens.weight.device.type == "cuda"


def block_decoder_for(decoder, lean: bool = True, fast: bool = False,
                      static=None) -> DecoderStep:
    """The step for ``decoder``.

    ``fast``: the fastest step that computes the decoder's function on its device, the static
    step on CUDA, the fast step in float32 on the CPU; else (or without ``fast``) the lean step
    where the decoder's layers allow it, else fairseq's modules (``lean=False`` asks for them).
    ``static``: True asks for the static step on any device (the tests run it on the CPU),
    False never gives it; None: with ``fast`` on CUDA.
    """
    check_supported_decoder(decoder)
    if lean and static is not False and (static or (fast and _on_cuda(decoder))):
        if static_supported(decoder):
            return StaticBlockDecoder(decoder)
    if lean and fast:
        if fast_supported(decoder):
            return FastBlockDecoder(decoder)
    if lean and lean_supported(decoder):
        return LeanBlockDecoder(decoder)
    if lean:
        _log_fallback(decoder)
    return BlockDecoder(decoder)


def _log_fallback(decoder):
    """Say once per decoder class that the engine runs fairseq's slower modules: the lean step
    is several times faster, so a user comparing speeds needs to know which one ran."""
    kind = type(decoder).__name__
    if kind in _fallbacks_logged:
        return
    _fallbacks_logged.add(kind)
    logger.warning("%s's layers use options the lean decoder step does not reproduce "
                   "(NormFormer, bias_kv, cross-self-attention, ...): decoding with fairseq's "
                   "own modules, which is slower", kind)


class ChosenStep(NamedTuple):
    """A decoder step and the encoder that goes with it (``encode(net_input)`` -> fairseq's
    encoder output dictionary)."""

    step: DecoderStep
    encode: Callable


def encoder_for(encoder, step: DecoderStep) -> Callable:
    """The encoder for ``step``: with a fast step, the fast encoder on the step's own product
    kernels where it computes the encoder's function (cpu/fast_encoder.py); else fairseq's."""
    if step.fast and fast_encoder_supported(encoder):
        return FastEncoder(encoder, step.kernels)
    return encoder.forward_torchscript


def _weight_key(module) -> tuple:
    """The device and dtype of a fairseq encoder's or decoder's token embedding (the
    parameter every device or dtype change moves with the rest); () for an encoder without
    one (the fast encoder covers none such)."""
    embed = getattr(module, "embed_tokens", None)
    if embed is None:
        return ()
    weight = embed.weight
    return weight.device, weight.dtype


class StepChoice:
    """The step and encoder for a model as it is now (:func:`block_decoder_for`,
    :func:`encoder_for`), chosen again when the device or dtype of its decoder or encoder
    changed, and kept while they stay: a steady run looks one key up per batch, and the step
    keeps its prepared weights and measured kernels. A change of the weights' values at the
    same device and dtype is the step's own business (step/weights_key.py).

    Only the current choice is kept: a step holds its prepared copy of the weights (and the
    static step its CUDA buffers and graphs), which a model moved elsewhere no longer needs.
    """

    def __init__(self, model, lean: bool = True, fast: bool = False):
        check_supported_decoder(model.decoder)  # refused when the generator is built
        self.model = model
        self.lean, self.fast = lean, fast
        self._chosen: Optional[Tuple[tuple, ChosenStep]] = None
        self._lock = threading.Lock()  # two threads starting together build one step

    def key(self) -> tuple:
        """Everything the choice depends on that may change after the generator was built."""
        return _weight_key(self.model.decoder) + _weight_key(self.model.encoder)

    def current(self) -> ChosenStep:
        key = self.key()
        chosen = self._chosen  # read once: another thread may replace it
        if chosen is None or chosen[0] != key:
            with self._lock:
                chosen = self._chosen
                if chosen is None or chosen[0] != key:
                    step = block_decoder_for(self.model.decoder, self.lean, self.fast)
                    chosen = self._chosen = (key, ChosenStep(step, encoder_for(self.model.encoder,
                                                                                step)))
        return chosen[1]
