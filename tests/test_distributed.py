"""Multi-process training (issue #16): our models and criteria under fairseq's distributed training.

Two CPU processes (gloo), launched one per rank as docs/distributed-training.md says, must train
exactly as one process does on the same batches. fairseq deals an update's batches round-robin
(``ShardedIterator``: rank r takes batches r, r + N, ... of the shuffled list, then groups
``--update-freq`` consecutive ones), so N ranks with ``--update-freq F`` see, per update, the same
N x F batches as one process with ``--update-freq N x F``, and fairseq normalises the summed
gradient by the summed sample size in both. Dropout is off (its masks come from torch's global
stream); our criteria's own draws are keyed by update and batch (criterions/seeding.py), so they
agree. Compared: the logged loss, sentences and tokens of every update, the validation loss and
every parameter of the final checkpoint.
"""

import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest
import torch

from forked_cli import run_module
from test_cli import PLUGIN  # cli_data: a fixture of conftest.py, built once per test run

SIZES = (
    "--encoder-layers 1 --decoder-layers 1 --encoder-embed-dim 32 --decoder-embed-dim 32 "
    "--encoder-ffn-embed-dim 64 --decoder-ffn-embed-dim 64 --encoder-attention-heads 2 "
    "--decoder-attention-heads 2 --share-all-embeddings"
).split()
COMMON = SIZES + (
    "--task translation_pardec --cpu --optimizer adam --lr 0.003 --dropout 0 --seed 1 "
    "--num-workers 0 --no-progress-bar --log-format json --log-interval 1 --no-epoch-checkpoints "
    "--batch-size 8 --max-update 4"
).split()
RANKS = 2
TIMEOUT = 300

# name: (flags, --update-freq of each rank, validate); BASE is a trained tiny transformer
CASES = {
    "blockwise-frozen": (
        "--arch blockwise_transformer --proposal-heads 3 --identity-first-head --freeze-base "
        "--init-from-transformer BASE --criterion blockwise_cross_entropy --label-smoothing 0.1",
        1, False),
    "blockwise-light-position": (
        "--arch blockwise_transformer --proposal-heads 3 --identity-first-head --freeze-base "
        "--init-from-transformer BASE --proposal-layer light --proposal-hidden-dim 8 "
        "--criterion blockwise_cross_entropy --head-sampling position --label-smoothing 0.1",
        1, False),
    "glat-block-causal-verifier": (
        "--arch glat_drafter --drafter-block-size 4 --criterion glat_loss "
        "--glat-anneal-updates 10 --drafter-attention block-causal --drafter-encoder verifier "
        "--init-from-verifier BASE --init-drafter-decoder --label-smoothing 0.1",
        1, True),
    "ibdecoder": (
        "--arch ibdecoder --ib-directions 2 --ib-words-per-direction 1 "
        "--criterion label_smoothed_cross_entropy --label-smoothing 0.1",
        2, False),  # 2 ranks x --update-freq 2 (fairseq's no_sync path) vs 1 x 4
}

# torch's DDP refuses the device_ids fairseq passes it for a CPU module; without them it runs
# fairseq's own --ddp-backend pytorch_ddp code path (the GPU default) on CPU. Test-only.
PYTORCH_DDP_ON_CPU = """
import sys
import fairseq.models.distributed_fairseq_model as dfm
from torch.nn.parallel import DistributedDataParallel


class CpuDistributedDataParallel(DistributedDataParallel):
    def __init__(self, module, device_ids=None, output_device=None, **kwargs):
        super().__init__(module, **kwargs)


dfm.DistributedDataParallel = CpuDistributedDataParallel
from fairseq_cli.train import cli_main

cli_main()
"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(data, save_dir, flags, ranks=1, script=None):
    """Run fairseq-train (one process, or one per rank on 127.0.0.1); rank 0's output."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    entry = [script] if script else ["-m", "fairseq_cli.train"]
    args = [sys.executable, *entry, str(data), "--user-dir", PLUGIN, *COMMON,
            "--save-dir", str(save_dir), *map(str, flags)]
    os.makedirs(save_dir, exist_ok=True)
    if ranks == 1:
        if script is None:  # a child forked from a process that imported torch and fairseq
            proc = run_module("fairseq_cli.train", args[3:], env, timeout=TIMEOUT)
        else:
            proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=TIMEOUT)
        return proc.returncode, proc.stdout + proc.stderr
    for _attempt in range(2):  # a port taken between free_port() and the bind: try another
        port = free_port()
        logs = [open(os.path.join(save_dir, "rank%d.log" % r), "w+") for r in range(ranks)]
        procs = []
        try:
            for rank in range(ranks):
                launch = ["--distributed-world-size", ranks, "--distributed-backend", "gloo",
                          "--distributed-init-method", "tcp://127.0.0.1:%d" % port,
                          "--distributed-rank", rank, "--distributed-no-spawn", "--device-id", 0]
                procs.append(subprocess.Popen(args + [str(a) for a in launch], stdout=logs[rank],
                                              stderr=subprocess.STDOUT, text=True, env=env))
            codes = wait_all(procs)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        outputs = []
        for log in logs:
            log.seek(0)
            outputs.append(log.read())
            log.close()
        if "Address already in use" not in "".join(outputs):
            break
    code = next((c for c in codes if c != 0), 0)
    return code, outputs[0] if code == 0 else "\n".join(outputs)


def wait_all(procs, grace=30):
    """Exit codes of all ranks; a rank that fails leaves the others stuck in a collective: they
    get ``grace`` seconds, then are killed ("killed"). TIMEOUT in all."""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        if any(p.poll() not in (None, 0) for p in procs):
            deadline = min(deadline, time.monotonic() + grace)
        time.sleep(0.2)
    killed = []
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
            killed.append(p)
    return ["killed" if p in killed else p.returncode for p in procs]


def records(output, kind):
    """The JSON stats fairseq logs per update ("train_inner") or per validation ("valid")."""
    return [json.loads(m.group(1)) for m in re.finditer(r"\b%s\b\W+(\{.*\})" % kind, output)]


def assert_same_training(single, multi):
    one, many = records(single, "train_inner"), records(multi, "train_inner")
    assert len(one) == len(many) == 4, (single[-2000:], multi[-2000:])
    for a, b in zip(one, many):
        assert a["num_updates"] == b["num_updates"]
        # the same sentences and target tokens per update: the same batches
        assert (a["bsz"], a["wpb"]) == (b["bsz"], b["wpb"]), (a, b)
        for key in ("loss", "nll_loss", "gnorm"):
            if key in a:
                x, y = float(a[key]), float(b[key])
                assert abs(x - y) <= 1e-3 * abs(x) + 1e-3, (key, a, b)  # logged with 3 decimals


def assert_same_weights(path_a, path_b, atol=1e-5):
    a = torch.load(path_a, map_location="cpu", weights_only=False)["model"]
    b = torch.load(path_b, map_location="cpu", weights_only=False)["model"]
    assert a.keys() == b.keys()
    for key in a:
        # A bias added to every key cannot change an attention softmax: its gradient is 0 up to
        # rounding, which depends on the order of the sums, and Adam turns that noise into steps
        # of up to --lr each (seen: 1.5e-5 after 4 updates). Every other parameter: within atol.
        tol = 0.003 * 4 if key.endswith("k_proj.bias") else atol
        assert torch.allclose(a[key].float(), b[key].float(), rtol=0, atol=tol), key


@pytest.fixture(scope="module")
def base(cli_data, tmp_path_factory):
    """A tiny transformer of the same sizes: the frozen base / verifier of the cases above."""
    _, data = cli_data
    save = tmp_path_factory.mktemp("dist-base")
    code, out = train(data, save, ["--arch", "transformer", "--disable-validation",
                                   "--batch-size", 32, "--max-update", 6])
    assert code == 0, out[-3000:]
    return save / "checkpoint_last.pt"


def case_flags(name, base_path):
    flags, update_freq, validate = CASES[name]
    flags = flags.replace("BASE", str(base_path)).split()
    return flags + ([] if validate else ["--disable-validation"]), update_freq


@pytest.fixture(scope="module")
def single_process(cli_data, base, tmp_path_factory):
    """One process with --update-freq RANKS x F, per case, run once: (output, checkpoint)."""
    _, data = cli_data
    done = {}

    def get(name):
        if name not in done:
            flags, update_freq = case_flags(name, base)
            save = tmp_path_factory.mktemp("dist-single-" + name)
            code, out = train(data, save, flags + ["--update-freq", RANKS * update_freq])
            assert code == 0, out[-3000:]
            done[name] = out, save / "checkpoint_last.pt"
        return done[name]

    return get


@pytest.mark.parametrize("name", list(CASES))
def test_two_processes_train_as_one(cli_data, base, single_process, tmp_path, name):
    """--ddp-backend legacy_ddp, gloo: the launch that works on CPU (docs/distributed-training.md)."""
    _, data = cli_data
    flags, update_freq = case_flags(name, base)
    code, multi = train(data, tmp_path, flags + ["--update-freq", update_freq,
                                                 "--ddp-backend", "legacy_ddp"], ranks=RANKS)
    assert code == 0, multi[-4000:]
    single, single_ckpt = single_process(name)
    assert_same_training(single, multi)
    assert_same_weights(single_ckpt, tmp_path / "checkpoint_last.pt")
    if CASES[name][2]:
        (a,), (b,) = records(single, "valid"), records(multi, "valid")
        assert abs(float(a["valid_loss"]) - float(b["valid_loss"])) <= 1e-3 * abs(float(a["valid_loss"]))
    if "--freeze-base" in flags:  # the frozen base is the base, to the bit: no step touches it
        trained = torch.load(tmp_path / "checkpoint_last.pt", map_location="cpu", weights_only=False)["model"]
        original = torch.load(base, map_location="cpu", weights_only=False)["model"]
        for key, value in original.items():
            if key in trained and "version" not in key:
                assert torch.equal(trained[key], value), key


@pytest.mark.parametrize("name", ["blockwise-frozen", "glat-block-causal-verifier"])
def test_pytorch_ddp_code_path(cli_data, base, single_process, tmp_path, name):
    """fairseq's --ddp-backend pytorch_ddp (torch's DDP, the GPU default), run on CPU with the
    device_ids dropped: a frozen base (or frozen verifier encoder) needs no
    --find-unused-parameters, and GLAT's gradients are all-reduced (its criterion's gradient pass
    goes through the model's forward; before, each rank kept its own)."""
    _, data = cli_data
    script = tmp_path / "pytorch_ddp_on_cpu.py"
    script.write_text(PYTORCH_DDP_ON_CPU)
    flags, update_freq = case_flags(name, base)
    code, multi = train(data, tmp_path / "ckpt", flags + ["--update-freq", update_freq,
                                                          "--ddp-backend", "pytorch_ddp"],
                        ranks=RANKS, script=str(script))
    assert code == 0, multi[-4000:]
    single, single_ckpt = single_process(name)
    assert_same_training(single, multi)
    assert_same_weights(single_ckpt, tmp_path / "ckpt" / "checkpoint_last.pt")


def test_pytorch_ddp_refuses_cpu_in_this_fairseq(tmp_path):
    """As documented: fairseq passes device_ids=[--device-id] to torch's DDP, which refuses a CPU
    module, so --ddp-backend pytorch_ddp (or c10d) cannot train on CPU; legacy_ddp can. (In this
    process, with a one-rank gloo group: the same call a rank makes after the rendezvous.)"""
    import argparse

    import torch.distributed as dist
    from fairseq.models import DistributedFairseqModel

    args = argparse.Namespace(
        tpu=False, ddp_backend="pytorch_ddp", device_id=0, broadcast_buffers=False,
        bucket_cap_mb=25, find_unused_parameters=False, gradient_as_bucket_view=False,
        ddp_comm_hook="none", heartbeat_timeout=-1)
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method="file://%s" % (tmp_path / "rendezvous"),
                            world_size=1, rank=0)
    try:
        with pytest.raises(ValueError, match="device_ids and output_device arguments only work"):
            DistributedFairseqModel(args, torch.nn.Linear(2, 2), dist.group.WORLD, torch.device("cpu"))
        args.ddp_backend = "legacy_ddp"
        assert DistributedFairseqModel(args, torch.nn.Linear(2, 2), dist.group.WORLD, "cpu")
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------- unused parameters, in one process
def build(data, flags):
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, [str(data), "--user-dir", PLUGIN, *COMMON, *flags])
    cfg = convert_namespace_to_omegaconf(args)
    task = tasks.setup_task(cfg.task)
    model, criterion = task.build_model(cfg.model), task.build_criterion(cfg.criterion)
    task.load_dataset("train")
    batches = task.get_batch_iterator(task.dataset("train"), max_sentences=8, seed=1)
    return model, criterion, batches.next_epoch_itr(shuffle=True)


@pytest.mark.parametrize("name", list(CASES))
def test_every_trainable_parameter_gets_a_gradient(cli_data, base, name):
    """So torch's DDP needs no --find-unused-parameters for our models (a parameter that takes no
    part in a step would stop it), whichever heads, prefixes or glances a batch draws; frozen
    parts (requires_grad False) are left out by both DDP wrappers."""
    _, data = cli_data
    flags, _ = case_flags(name, base)
    model, criterion, batches = build(data, flags)
    model.train()
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert bool(frozen) == ("--freeze-base" in flags or "verifier" in flags)
    for step, sample in zip(range(4), batches):
        if hasattr(criterion, "set_update_num"):
            criterion.set_update_num(step)
        model.zero_grad(set_to_none=True)
        loss, _, _ = criterion(model, sample)
        loss.backward()
        missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
        assert not missing, (step, missing)
        assert all(p.grad is None for n, p in model.named_parameters() if n in frozen)
