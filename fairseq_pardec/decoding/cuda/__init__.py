"""The decoder step on CUDA (``static``): fixed shapes on fixed buffers, recorded as graphs
(``cuda_graphs``), its slots within a memory budget (``slot_pool``).
"""
