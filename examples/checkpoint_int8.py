"""A fairseq checkpoint carried in pieces of bounded size, its matrices rounded to int8.

The GPU machine sends back at most 64 MiB in files of 16 MiB: a transformer-base checkpoint
(48M parameters) is 97 MB in float16. ``pack`` drops the optimizer's state and stores every
floating matrix as int8 with one float32 scale per row (symmetric, round to nearest; vectors such
as biases and layer norms stay float32), tensors that share storage once, and cuts the file into
pieces of at most ``--piece-mib``. ``unpack`` joins the pieces and writes an ordinary float32
checkpoint of the rounded weights.

The unpacked model is not the trained one bit for bit: it is the model whose weights are the
rounded ones, a model of its own. Decode and measure that file on every machine (the GPU checks
unpack it there too), so that all figures belong to the same weights.

    python examples/checkpoint_int8.py pack CKPT OUT_PREFIX [--piece-mib 15]
    python examples/checkpoint_int8.py unpack OUT.pt PIECE [PIECE ...]
"""

import argparse
import io
import os

import torch


def _quantized(tensor):
    if not tensor.is_floating_point() or tensor.dim() < 2:
        return {"float": tensor.float()} if tensor.is_floating_point() else {"other": tensor}
    rows = tensor.float().reshape(tensor.size(0), -1)
    scale = rows.abs().amax(dim=1).clamp_min(1e-12) / 127.0
    values = torch.round(rows / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return {"int8": values, "scale": scale, "shape": tuple(tensor.shape)}


def _restored(entry):
    if "int8" in entry:
        return (entry["int8"].float() * entry["scale"][:, None]).reshape(entry["shape"])
    return entry.get("float", entry.get("other"))


def pack(path, prefix, piece_mib):
    checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    checkpoint.pop("last_optimizer_state", None)
    shared, model = {}, {}
    for name, tensor in checkpoint["model"].items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key in shared:  # tied embeddings: one copy, restored as one tensor
            model[name] = {"same_as": shared[key]}
        else:
            shared[key] = name
            model[name] = _quantized(tensor)
    checkpoint["model"] = model
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    data = buffer.getvalue()
    size = piece_mib << 20
    pieces = []
    for i in range(0, len(data), size):
        piece = "%s.part%02d" % (prefix, i // size)
        with open(piece, "wb") as f:
            f.write(data[i: i + size])
        pieces.append(piece)
    print("%s: %.1f MB in %d pieces" % (path, len(data) / 1e6, len(pieces)))
    return pieces


def unpack(out, pieces):
    data = b"".join(open(p, "rb").read() for p in sorted(pieces))
    checkpoint = torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
    model = {}
    for name, entry in checkpoint["model"].items():
        if "same_as" not in entry:
            model[name] = _restored(entry)
    for name, entry in checkpoint["model"].items():
        if "same_as" in entry:
            model[name] = model[entry["same_as"]]
    checkpoint["model"] = model
    tmp = out + ".tmp"
    torch.save(checkpoint, tmp)
    os.replace(tmp, out)
    print("%s: %d tensors" % (out, len(model)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack")
    p.add_argument("checkpoint")
    p.add_argument("prefix")
    p.add_argument("--piece-mib", type=int, default=15)
    u = sub.add_parser("unpack")
    u.add_argument("out")
    u.add_argument("pieces", nargs="+")
    a = parser.parse_args()
    if a.command == "pack":
        pack(a.checkpoint, a.prefix, a.piece_mib)
    else:
        unpack(a.out, a.pieces)


if __name__ == "__main__":
    main()
