"""The decoder step: its Protocol and the reference step, on which the CPU's and CUDA's faster
steps build.

``interface`` declares what the engine asks of a step; ``block_decoder.BlockDecoder`` runs
fairseq's own modules; ``lean`` repeats fairseq's operations in fairseq's order on its own
cache; ``one_row_steps`` replays fairseq's one-row steps for the margin guard; ``margins``,
``calibration`` and ``rounding_spread`` are what a step's rounding against fairseq's is, and
how it is measured; ``block_layout`` packs ragged blocks; ``output_projection`` scores the
vocabulary; ``weights_key`` tells when the weights changed. The fast CPU step is
``decoding/cpu``, the CUDA step ``decoding/cuda``, and ``decoding/step_factory`` picks one per
decoder, device and dtype.
"""
