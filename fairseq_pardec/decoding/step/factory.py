"""Which decoder step decodes a model: one choice per decoder, device and dtype.

* the static step (step/static.py) on CUDA: fixed shapes, recorded as CUDA graphs;
* the fast step (step/fast.py) in float32 on the CPU: native kernels, a static cache;
* the lean step (step/lean.py) elsewhere: fairseq's operations in fairseq's order;
* fairseq's own modules (step/block_decoder.py) for layers the lean step does not reproduce.

Every step declares how it rounds (step/margins.py): the static and fast steps round otherwise
than fairseq everywhere; the lean step (on CUDA, or with the model's own output layer) and the
modules round as fairseq does only one position per row, since a block multiplies matrices of
other shapes. The engine's guard decides the close calls wherever a margin applies.
"""

import logging

from fairseq_pardec.decoding.step.block_decoder import BlockDecoder, check_supported_decoder

logger = logging.getLogger(__name__)
_fallbacks_logged = set()


def _on_cuda(decoder) -> bool:
    return decoder.embed_tokens.weight.device.type == "cuda"


def block_decoder_for(decoder, lean: bool = True, fast: bool = False,
                      static=None) -> BlockDecoder:
    """The step for ``decoder``.

    ``fast``: the fastest step that computes the decoder's function on its device, the static
    step on CUDA, the fast step in float32 on the CPU; else (or without ``fast``) the lean step
    where the decoder's layers allow it, else fairseq's modules (``lean=False`` asks for them).
    ``static``: True asks for the static step on any device (the tests run it on the CPU),
    False never gives it; None: with ``fast`` on CUDA.
    """
    check_supported_decoder(decoder)
    from fairseq_pardec.decoding.step.lean import LeanBlockDecoder, lean_supported

    if lean and static is not False and (static or (fast and _on_cuda(decoder))):
        from fairseq_pardec.decoding.step.static import StaticBlockDecoder, static_supported

        if static_supported(decoder):
            return StaticBlockDecoder(decoder)
    if lean and fast:
        from fairseq_pardec.decoding.step.fast import FastBlockDecoder, fast_supported

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
