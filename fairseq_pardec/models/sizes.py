"""Architecture sizes shared by the plugin's model families."""


def tiny_sizes(args):
    """d64, 2+2 layers, 2 heads: the ``*_tiny`` archs, for tests and smoke runs."""
    for side in ("encoder", "decoder"):
        for name, value in (("embed_dim", 64), ("ffn_embed_dim", 128), ("layers", 2),
                            ("attention_heads", 2)):
            key = "%s_%s" % (side, name)
            setattr(args, key, getattr(args, key, value))
