"""The fast decoder step on the CPU (``fast``), its encoder (``fast_encoder``), the choice of
product kernel per row count (``products``) and a decoder call's layers in one native call
(``layer_stack``), on the kernels of ``fairseq_pardec/native``.
"""
