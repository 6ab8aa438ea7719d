"""Per-row cache rollback leaves exactly the keys/values of a fresh forward over the prefix."""

import torch

from fairseq_pardec.decoding.step.block_decoder import BlockDecoder

from helpers import make_dictionary, make_task, random_batch, tiny_transformer


def cached_entries(blocks, state, row):
    """Per layer: the (H, T_valid, d) keys and values row ``row`` attends to, in cache order."""
    valid = blocks.valid_mask(state)[row]
    out = []
    for attn in blocks.self_attns:
        buf = attn._get_input_buffer(state)
        out.append((buf["prev_key"][row][:, valid], buf["prev_value"][row][:, valid]))
    return out


def test_rollback_matches_fresh_forward():
    d = make_dictionary(40)
    model = tiny_transformer(make_task(d), seed=11)
    blocks = BlockDecoder(model.decoder)
    bsz = 5
    sample = random_batch(d, [4, 9, 1, 15, 6], seed=2)
    enc = model.encoder.forward_torchscript(sample["net_input"])
    g = torch.Generator().manual_seed(0)
    accepted = [[d.eos()] for _ in range(bsz)]  # decoder inputs kept in the cache (BOS first)
    state = {}
    with torch.no_grad():
        for _ in range(7):
            width = int(torch.randint(1, 6, (1,), generator=g))
            lens = torch.randint(1, width + 1, (bsz,), generator=g)  # ragged real block lengths
            block = torch.randint(4, len(d), (bsz, width), generator=g)
            block_pad = torch.arange(width).unsqueeze(0) >= lens.unsqueeze(1)
            start = torch.tensor([len(a) - 1 for a in accepted])
            # first block token of each row is its last accepted token (not yet cached)
            block[:, 0] = torch.tensor([a[-1] for a in accepted])
            blocks.forward_block(block, start, block_pad, enc, state)
            keep = torch.stack([torch.randint(1, int(n) + 1, (1,), generator=g)[0] for n in lens])
            blocks.rollback(state, width, keep)
            blocks.compact(state, min_holes=0.3)
            for r in range(bsz):
                # kept block tokens after the first are now accepted; a fresh token ends the row
                accepted[r] = accepted[r] + block[r, 1 : int(keep[r])].tolist() + [5 + r]

        for r in range(bsz):
            fresh = {}
            sub = model.encoder.reorder_encoder_out(enc, torch.tensor([r]))
            prefix = torch.tensor([accepted[r][:-1]])
            blocks.forward_block(prefix, torch.tensor([0]), torch.zeros_like(prefix, dtype=torch.bool), sub, fresh)
            for (k1, v1), (k2, v2) in zip(cached_entries(blocks, state, r), cached_entries(blocks, fresh, 0)):
                assert k1.shape == k2.shape
                assert torch.allclose(k1, k2, atol=1e-5)
                assert torch.allclose(v1, v2, atol=1e-5)


def test_block_equals_token_by_token():
    """One forward over a block gives the log-probs of feeding its tokens one at a time."""
    d = make_dictionary(40)
    model = tiny_transformer(make_task(d), seed=12)
    blocks = BlockDecoder(model.decoder)
    sample = random_batch(d, [6, 3], seed=3)
    enc = model.encoder.forward_torchscript(sample["net_input"])
    tokens = torch.tensor([[2, 7, 8, 9, 10], [2, 11, 12, 13, 14]])
    with torch.no_grad():
        whole = blocks.log_probs(blocks.forward_block(tokens, torch.zeros(2, dtype=torch.long),
                                     torch.zeros_like(tokens, dtype=torch.bool), enc, {}))
        state, steps = {}, []
        for i in range(tokens.size(1)):
            steps.append(blocks.log_probs(blocks.forward_block(
                tokens[:, i : i + 1], torch.full((2,), i), torch.zeros(2, 1, dtype=torch.bool), enc, state)))
        # and fairseq's own full forward
        full = model.get_normalized_probs(model.decoder(tokens, encoder_out=enc), log_probs=True)
    assert torch.allclose(whole, torch.cat(steps, dim=1), atol=1e-5)
    assert torch.allclose(whole, full, atol=1e-5)
