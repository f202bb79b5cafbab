"""PyTorch's own FSDP2 and DDP on the model of ``fsdp-bench train``: a benchmark peer.

Trains libfsdp's ``models::Decoder`` (models/src/llm.cpp, layers.cpp), rebuilt
here op for op in Python, with the same seed, initialisation
(``models::init_weights``), synthetic data, global batch and AdamW settings as
``fsdp-bench train``, on CPU over gloo, and reports that command's columns,
so that the two can be set side by side. Launched by Open MPI's mpiexec (rank
and size from OMPI_COMM_WORLD_*; torchrun's RANK/WORLD_SIZE also work; neither:
one process), e.g.::

    mpiexec -n 2 python torch_fsdp2.py --config torch-fsdp2 --json out.json

Configurations (``--config``, comma-separated; several run interleaved step by
step in one process, like the C++ harness's ``time_interleaved``):

  single               the plain model, the whole global batch, no
                       communication; every rank runs it at once
  torch-ddp            DistributedDataParallel, default buckets, float32
  torch-fsdp2          fully_shard on each decoder layer, then on the root
                       (embedding, tied output, final norm), 1-D mesh,
                       reshard_after_forward left at its default
  torch-fsdp2-reshard  as torch-fsdp2, reshard_after_forward=True everywhere
  torch-fsdp2-hpz      as torch-fsdp2-reshard with reshard_after_forward = the ranks on
                       this node (FSDP2's int form; True where one node holds the world)
                       (the root too)
  torch-hsdp           as torch-fsdp2 on a (replicate = W/2, shard = 2) mesh

On gloo, FSDP2's reduce-scatter (reduce_scatter_single) is carried out by
ProcessGroupGloo as a clone of the whole input, an all-reduce of it and a
copy of this rank's chunk: its traffic and scratch are an all-reduce's, which
weighs on the FSDP2 step times beside an MPI_Reduce_scatter.

``--param-dtype bfloat16`` gives the FSDP2/HSDP configurations
MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32); single and
torch-ddp stay float32, as in fsdp-bench.

Columns, as fsdp-bench train's (times: median over the timed steps of the
slowest rank; bytes: max over ranks):

  step_ms, step_min_ms, step_max_ms  one step (zero_grad, forward + loss,
        backward, AdamW step) after a barrier
  forward_ms   zero_grad + forward + loss (FSDP2: with its all-gathers)
  backward_ms  backward (FSDP2: with its reduce-scatters; DDP: with its
               all-reduces, which its reducer overlaps with backward)
  sync_ms      always 0: no configuration here synchronises after backward
               (fsdp-bench's plain "ddp" does, in its own column)
  optimizer_ms the AdamW step
  persistent_bytes = params_bytes + grads_bytes + optimizer_bytes: parameters
        as held between steps (FSDP2: the local shards, DTensor.to_local()),
        their gradients and AdamW's exp_avg / exp_avg_sq (/ max_exp_avg_sq),
        sums of tensor sizes
  held_bytes, peak_bytes  CPU-allocator bytes owned by the configuration
        between steps / at the highest point of a step. Python exposes no CPU
        allocator statistics, so after the timed loop a fresh copy of the
        configuration is built and run for two steps under torch.profiler
        with profile_memory=True, then deleted: the profiler reports every
        CPU block allocated and freed while it records, with size and
        address, so their running sum counts that copy's bytes alone --
        model, gradients, optimizer state, DDP buckets, FSDP2 buffers -- and
        not the other configurations of the process. held is the sum at the
        end of the second step, peak its maximum during it. The profiler sees
        only the threads it records, not gloo's workers, which free the
        copies gloo's collectives make; see held_and_peak for how those are
        placed. Like fsdp-bench's counting allocator it counts LibTorch's
        allocator only, not gloo's own or BLAS scratch; unlike it, it sees
        one step, not the maximum over the timed ones.
  collectives_per_step "AG/RS/AR": all-gathers / reduce-scatters /
        all-reduces issued through torch.distributed's Python functions during
        one extra untimed step. torch-ddp's reducer issues its all-reduces in
        C++; for that step only it is given DDP's documented equivalent
        allreduce_hook, which issues the same one all-reduce per bucket from
        Python, where it is counted.
  final_loss   the loss after the last timed step, the global batch's (mean
               over the data-parallel ranks of their slices' losses)
"""

import os

# Kineto reports that it finds no GPU as an ERROR line on every rank; the
# user's own setting wins.
os.environ.setdefault("KINETO_LOG_LEVEL", "5")

import argparse
import bisect
import contextlib
import functools
import gc
import json
import math
import statistics
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed import distributed_c10d
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import _default_to_fused_or_foreach
from torch.profiler import ProfilerActivity, profile, record_function

CONFIGS = ("single", "torch-ddp", "torch-fsdp2", "torch-fsdp2-reshard", "torch-fsdp2-hpz",
           "torch-hsdp")
FSDP_CONFIGS = ("torch-fsdp2", "torch-fsdp2-reshard", "torch-fsdp2-hpz", "torch-hsdp")
MIB = 1024.0 * 1024.0


# ---- launch -----------------------------------------------------------------
def launch_env():
    """(rank, world size, ranks on this node) from Open MPI, else torchrun, else 1.

    The local rank is not needed: everything runs on the CPU."""
    for rank, world, local_size in (
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"),
        ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"),
    ):
        if world in os.environ:
            return (int(os.environ[rank]), int(os.environ[world]),
                    int(os.environ.get(local_size, os.environ[world])))
    return 0, 1, 1


RANK, WORLD, LOCAL_SIZE = launch_env()


class RankZeroParser(argparse.ArgumentParser):
    """Every rank parses and exits alike; only rank 0 prints usage and errors."""

    def _print_message(self, message, file=None):
        if RANK == 0:
            super()._print_message(message, file)


def positive(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, not {text}")
    return value


def non_negative(text):
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, not {text}")
    return value


def seed_value(text):
    value = int(text)
    if not 0 <= value < 2**64:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, 2^64 - 1], not {text}")
    return value


def config_list(text):
    keys = [k.strip() for k in text.split(",") if k.strip()]
    unknown = [k for k in keys if k not in CONFIGS]
    if not keys or unknown:
        raise argparse.ArgumentTypeError(
            f"unknown configuration(s) {','.join(unknown) or repr(text)}; "
            f"accepted (comma-separated): {', '.join(CONFIGS)}")
    if len(set(keys)) != len(keys):
        raise argparse.ArgumentTypeError(f"a configuration is named twice in {text}")
    return keys


def parse_args():
    p = RankZeroParser(
        description="PyTorch FSDP2 / DDP peer of `fsdp-bench train` (CPU, gloo); "
                    "run under mpiexec, rank 0 prints.")
    p.add_argument("--config", type=config_list, default=list(CONFIGS),
                   help=f"configurations, comma-separated, from: {', '.join(CONFIGS)} "
                        "(default: all)")
    p.add_argument("--batch", type=positive, default=8,
                   help="global batch in sequences (a multiple of the ranks)")
    p.add_argument("--steps", type=positive, default=10, help="timed steps per configuration")
    p.add_argument("--warmup", type=non_negative, default=2, help="untimed steps first")
    p.add_argument("--vocab", type=positive, default=1024)
    p.add_argument("--hidden", type=positive, default=256, help="a multiple of --heads")
    p.add_argument("--heads", type=positive, default=4)
    p.add_argument("--layers", type=positive, default=4)
    p.add_argument("--seq", type=positive, default=128)
    p.add_argument("--seed", type=seed_value, default=1234, help="model and data seed")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    p.add_argument("--param-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="FSDP2/HSDP configs: MixedPrecisionPolicy param_dtype (reduce_dtype "
                        "float32); single and torch-ddp stay float32")
    p.add_argument("--threads", type=positive, default=None,
                   help="intra-op threads per rank (default: cores / ranks per node, as "
                        "libfsdp's Runtime)")
    p.add_argument("--master-addr", default=os.environ.get("MASTER_ADDR", "127.0.0.1"),
                   help="gloo rendezvous address (default: $MASTER_ADDR, else 127.0.0.1; "
                        "ci/cluster/fsdp-cluster sets it to node 0's)")
    p.add_argument("--master-port", type=positive,
                   default=int(os.environ.get("MASTER_PORT", 29517)),
                   help="gloo rendezvous port (default: $MASTER_PORT, else 29517)")
    p.add_argument("--json", metavar="FILE", help="also write the report as JSON to FILE")
    return p.parse_args()


def config_problem(args):
    """Why the configurations cannot run at this world size ("" if they can).

    Every rank computes the same answer from the same arguments, so all of
    them stop alike without talking to each other."""
    if args.hidden % args.heads:
        return f"--hidden {args.hidden} is not a multiple of --heads {args.heads}"
    if any(k != "single" for k in args.config) and args.batch % WORLD:
        return f"--batch {args.batch} is not a multiple of the world size {WORLD}"
    if "torch-hsdp" in args.config and WORLD % 2:
        return (f"torch-hsdp needs an even world size for its (replicate, shard=2) mesh, "
                f"not {WORLD}")
    return ""


# ---- the model: models::Decoder ---------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x):
        # The C++ layer's ops, not scaled_dot_product_attention, so that both
        # sides compute (and allocate) the same.
        b, s, h = x.shape
        hd = h // self.heads
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, hd).permute(2, 0, 3, 1, 4)
        scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        future = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        scores = scores.masked_fill(future, -math.inf)
        out = torch.matmul(torch.softmax(scores, -1), v).transpose(1, 2).reshape(b, s, h)
        return self.proj(out)


class SwiGLU(nn.Module):
    def __init__(self, hidden, ffn):
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn, bias=False)
        self.w3 = nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class DecoderLayer(nn.Module):
    def __init__(self, hidden, heads, ffn):
        super().__init__()
        self.attn_norm = RMSNorm(hidden)
        self.attn = Attention(hidden, heads)
        self.ffn_norm = RMSNorm(hidden)
        self.ffn = SwiGLU(hidden, ffn)

    def forward(self, x):
        h = x + self.attn(self.attn_norm(x))
        return h + self.ffn(self.ffn_norm(h))


def ffn_dim(hidden):
    """DecoderConfig::ffn_dim: SwiGLU's 2/3 * 4 * hidden, rounded up to 64."""
    return (2 * 4 * hidden // 3 + 63) // 64 * 64


class Decoder(nn.Module):
    """Embedding, decoder layers, final RMSNorm, output tied to the embedding.

    Children are registered in the C++ order (embed, layer0.., norm): the
    initialisation draws in named_parameters() order."""

    def __init__(self, vocab, hidden, heads, layers):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = []
        for i in range(layers):
            layer = DecoderLayer(hidden, heads, ffn_dim(hidden))
            self.add_module(f"layer{i}", layer)
            self.layers.append(layer)
        self.norm = RMSNorm(hidden)

    def forward(self, tokens):
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return F.linear(self.norm(h), self.embed.weight)


@torch.no_grad()
def init_weights(model, seed):
    """models::init_weights: biases 0, 1-D weights 1, the rest N(0, 0.02)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            p.zero_()
        elif p.dim() == 1:
            p.fill_(1.0)
        else:
            p.copy_(torch.normal(0.0, 0.02, p.shape, generator=gen, dtype=p.dtype))


def global_batch(args, round_index):
    """Round r's global batch, as fsdp-bench train draws it (seed arithmetic in uint64)."""
    gen = torch.Generator().manual_seed((args.seed * 1000 + round_index) % 2**64)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen,
                           dtype=torch.long)
    return tokens[:, :args.seq], tokens[:, 1:]


def local_nbytes(t):
    if t is None:
        return 0
    if isinstance(t, DTensor):
        t = t.to_local()
    return t.numel() * t.element_size()


# ---- one configuration --------------------------------------------------------
class Trainer:
    def __init__(self, key, args, meshes):
        self.key = key
        self.vocab = args.vocab
        # single runs the whole global batch on every rank; the others split
        # it over all ranks (HSDP's replicate and shard dims alike).
        self.data_rank, self.data_size = (0, 1) if key == "single" else (RANK, WORLD)
        model = Decoder(args.vocab, args.hidden, args.heads, args.layers)
        init_weights(model, args.seed)
        if key == "torch-ddp":
            self.net = DistributedDataParallel(model)
        elif key in FSDP_CONFIGS:
            kwargs = {"mesh": meshes[key]}
            if key == "torch-fsdp2-reshard":
                kwargs["reshard_after_forward"] = True
            if key == "torch-fsdp2-hpz":
                # FSDP2 takes an int that is a proper divisor of the shard size.
                kwargs["reshard_after_forward"] = (LOCAL_SIZE if 1 < LOCAL_SIZE < WORLD
                                                   else True)
            if args.param_dtype == "bfloat16":
                kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                           reduce_dtype=torch.float32)
            for layer in model.layers:
                fully_shard(layer, **kwargs)
            self.net = fully_shard(model, **kwargs)
        else:
            self.net = model
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
        self.last_loss = None

    def share(self, batch):
        rows = batch.size(0) // self.data_size
        return batch[self.data_rank * rows:(self.data_rank + 1) * rows].contiguous()

    def step(self, inputs, targets):
        """One training step; returns its (forward, backward, optimizer) seconds."""
        t0 = time.perf_counter()
        self.optimizer.zero_grad()
        logits = self.net(inputs)
        loss = F.cross_entropy(logits.reshape(-1, self.vocab), targets.reshape(-1))
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        self.optimizer.step()
        t3 = time.perf_counter()
        self.last_loss = loss.detach()
        return t1 - t0, t2 - t1, t3 - t2

    def persistent(self):
        """(params, grads, optimizer) bytes held between steps, local shards."""
        params = grads = optimizer = 0
        for p in self.model.parameters():
            params += local_nbytes(p)
            grads += local_nbytes(p.grad)
        for state in self.optimizer.state.values():
            # "step" is a scalar count, not a per-element state.
            optimizer += sum(local_nbytes(state.get(k))
                             for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"))
        return params, grads, optimizer

    def reshard_after_forward(self):
        """{"root", "layers"}: the effective setting after FSDP2's lazy init.

        Only the param groups know it: a default (None) root becomes False at
        lazy init, everything else True. Private API of torch 2.x."""
        if self.key not in FSDP_CONFIGS:
            return None

        def effective(module):
            groups = module._get_fsdp_state()._fsdp_param_groups
            return all(g._reshard_after_forward for g in groups)

        return {"root": effective(self.model),
                "layers": all(effective(layer) for layer in self.model.layers)}

    def optimizer_impl(self):
        """The AdamW implementation PyTorch's defaults pick for these parameters.

        With foreach and fused left None, AdamW never picks fused and asks
        this (private) helper about foreach: CUDA tensors only."""
        _, foreach = _default_to_fused_or_foreach(list(self.model.parameters()),
                                                  differentiable=False, use_fused=False)
        return "foreach" if foreach else "single_tensor (for-loop)"


def build_meshes(keys):
    meshes = {}
    if {"torch-fsdp2", "torch-fsdp2-reshard", "torch-fsdp2-hpz"} & set(keys):
        mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("shard",))
        meshes["torch-fsdp2"] = meshes["torch-fsdp2-reshard"] = meshes["torch-fsdp2-hpz"] = mesh
    if "torch-hsdp" in keys:
        meshes["torch-hsdp"] = init_device_mesh("cpu", (WORLD // 2, 2),
                                                mesh_dim_names=("replicate", "shard"))
    return meshes


# ---- measurements -------------------------------------------------------------
def time_interleaved(trainers, data, warmup, steps):
    """fsdp-bench's time_interleaved: every round runs every config once
    (reversed in odd rounds), each after a barrier; one MAX reduction at the
    end. Returns [config][step] step seconds and [config][step][phase] phase
    seconds, each the slowest rank's."""
    n = len(trainers)
    step_s = torch.zeros(n, steps, dtype=torch.float64)
    phase_s = torch.zeros(n, steps, 3, dtype=torch.float64)
    for rnd in range(warmup + steps):
        for k in range(n):
            v = k if rnd % 2 == 0 else n - 1 - k
            inputs, targets = data[v][rnd]
            dist.barrier()
            start = time.perf_counter()
            phases = trainers[v].step(inputs, targets)
            stop = time.perf_counter()
            if rnd >= warmup:
                step_s[v, rnd - warmup] = stop - start
                phase_s[v, rnd - warmup] = torch.tensor(phases, dtype=torch.float64)
    dist.all_reduce(step_s, op=dist.ReduceOp.MAX)
    dist.all_reduce(phase_s, op=dist.ReduceOp.MAX)
    return step_s.tolist(), phase_s.tolist()


# Every name under which torch.distributed offers each collective; FSDP2 in
# torch 2.15 calls all_gather_single / reduce_scatter_single (the older names
# are aliases of them). Names a release lacks are skipped.
COLLECTIVES = {
    "AG": ("all_gather_single", "all_gather_into_tensor", "all_gather", "_all_gather_base",
           "_allgather_base"),
    "RS": ("reduce_scatter_single", "reduce_scatter_tensor", "reduce_scatter",
           "_reduce_scatter_base"),
    "AR": ("all_reduce",),
}


@contextlib.contextmanager
def counting_collectives():
    """Counts calls to COLLECTIVES while active; yields {"AG", "RS", "AR": n}.

    Patched in torch.distributed (what callers use) and distributed_c10d
    (where the aliases call each other); only the outermost call counts, so
    an alias forwarding to all_gather_single is one all-gather."""
    counts = dict.fromkeys(COLLECTIVES, 0)
    nesting = threading.local()
    saved = []

    def counted(kind, fn):
        @functools.wraps(fn)
        def wrapper(*a, **kw):
            depth = getattr(nesting, "depth", 0)
            if depth == 0:
                counts[kind] += 1
            nesting.depth = depth + 1
            try:
                return fn(*a, **kw)
            finally:
                nesting.depth = depth
        return wrapper

    for module in (dist, distributed_c10d):
        for kind, names in COLLECTIVES.items():
            for name in names:
                fn = getattr(module, name, None)
                if fn is not None:
                    saved.append((module, name, fn))
                    setattr(module, name, counted(kind, fn))
    try:
        yield counts
    finally:
        for module, name, fn in reversed(saved):
            setattr(module, name, fn)


def chrome_trace(prof):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f)["traceEvents"]


def held_and_peak(trace):
    """(held, peak) bytes of the blocks allocated while the profile recorded.

    Live bytes are rebuilt from the CPU [memory] events' sizes and
    addresses. The profiler sees allocations and frees only on threads it
    records, and gloo frees the copies its collectives make (e.g. the whole
    input that its reduce-scatter clones and all-reduces) on its worker
    threads after the work is done, unseen. Such a block shows as never freed,
    or as its address handed out again: it is taken as freed when the first
    gloo collective that ends after its allocation ended."""
    step = next(e for e in trace
                if e.get("name") == "measured_step" and e.get("cat") == "user_annotation")
    begin, end = step["ts"], step["ts"] + step["dur"]
    gloo_ends = sorted(e["ts"] + e["dur"] for e in trace
                       if e.get("cat") == "user_annotation" and e["name"].startswith("gloo:"))
    # Device Type 0 is c10::DeviceType::CPU.
    events = sorted((e["ts"], e["args"]["Bytes"], e["args"]["Addr"]) for e in trace
                    if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0)
    changes = []  # (time, +/- bytes)
    live = {}  # address -> (allocated at, bytes)

    def freed_unseen(allocated_at, nbytes, no_later_than):
        i = bisect.bisect_left(gloo_ends, allocated_at)
        done = gloo_ends[i] if i < len(gloo_ends) else allocated_at
        changes.append((min(done, no_later_than), -nbytes))

    for ts, nbytes, addr in events:
        if nbytes > 0:
            if addr in live:
                freed_unseen(*live.pop(addr), no_later_than=ts)
            live[addr] = (ts, nbytes)
            changes.append((ts, nbytes))
        elif addr in live:
            del live[addr]
            changes.append((ts, nbytes))
    for allocated_at, nbytes in live.values():
        freed_unseen(allocated_at, nbytes, no_later_than=math.inf)

    level = peak = at_start = 0
    for ts, delta in sorted(changes):
        if ts > end:
            break
        level += delta
        if ts >= begin:
            peak = max(peak, level)
        else:
            at_start = level
    return level, max(peak, at_start)


def probe_memory(key, args, meshes, inputs, targets):
    """(held, peak) bytes of a fresh `key` trainer: see the module docstring."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        trainer = Trainer(key, args, meshes)
        # The first step creates the gradients, AdamW's state and FSDP2's
        # lazily initialised buffers; the second is the steady state.
        trainer.step(inputs, targets)
        with record_function("measured_step"):
            trainer.step(inputs, targets)
        # Freed here, on this thread, everything the trainer held shows a
        # free event; what never does was freed unseen (held_and_peak).
        del trainer
        gc.collect()
    return held_and_peak(chrome_trace(prof))


# ---- output -------------------------------------------------------------------
COLUMNS = [
    ("config", "config", ""),
    ("step_ms", "median", "ms"),
    ("step_min_ms", "min", "ms"),
    ("step_max_ms", "max", "ms"),
    ("forward_ms", "fwd", "ms"),
    ("backward_ms", "bwd", "ms"),
    ("sync_ms", "sync", "ms"),
    ("optimizer_ms", "optim", "ms"),
    ("persistent_bytes", "persistent", "bytes"),
    ("params_bytes", "params", "bytes"),
    ("grads_bytes", "grads", "bytes"),
    ("optimizer_bytes", "optimizer", "bytes"),
    ("held_bytes", "held", "bytes"),
    ("peak_bytes", "peak", "bytes"),
    ("collectives_per_step", "AG/RS/AR", "per step"),
    ("final_loss", "final loss", ""),
]


def print_table(meta, rows):
    m = meta["model"]
    print(f"# torch {meta['torch']} peer of fsdp-bench train: vocab {m['vocab']} hidden "
          f"{m['hidden']} heads {m['heads']} layers {m['layers']} ffn {m['ffn']} seq {m['seq']} "
          f"(tied), global batch {meta['global_batch']}, {meta['steps']} timed steps after "
          f"{meta['warmup']} warm-up, seed {meta['seed']}, param dtype {meta['param_dtype']}")
    print(f"# world {meta['world_size']} ({meta['ranks_per_node']} per node), "
          f"{meta['threads_per_rank']} thread(s) per rank, {meta['backend']}")
    for key, value in meta["reshard_after_forward"].items():
        print(f"# {key}: reshard_after_forward root {value['root']}, layers {value['layers']}")
    heads = ("config", "median", "min", "fwd", "bwd", "optim", "persist", "held", "peak",
             "AG/RS/AR", "final loss")
    units = ("", "(ms)", "(ms)", "(ms)", "(ms)", "(ms)", "(MiB)", "(MiB)", "(MiB)",
             "per step", "")
    widths = (19, 8, 8, 7, 7, 7, 8, 8, 8, 9, 10)
    print("#" + "".join(f" {h:>{w}}" for h, w in zip(heads, widths)))
    print("#" + "".join(f" {u:>{w}}" for u, w in zip(units, widths)))
    for r in rows:
        cells = (r["config"], f"{r['step_ms']:.1f}", f"{r['step_min_ms']:.1f}",
                 f"{r['forward_ms']:.1f}", f"{r['backward_ms']:.1f}", f"{r['optimizer_ms']:.1f}",
                 f"{r['persistent_bytes'] / MIB:.2f}", f"{r['held_bytes'] / MIB:.2f}",
                 f"{r['peak_bytes'] / MIB:.2f}", r["collectives_per_step"],
                 f"{r['final_loss']:.6f}")
        print(" " + "".join(f" {c:>{w}}" for c, w in zip(cells, widths)))


def json_problem(path):
    """Why rank 0 cannot write --json PATH ("" if it can), the same on every rank."""
    problem = [""]
    if RANK == 0 and path:
        directory = os.path.dirname(os.path.abspath(path))
        if os.path.isdir(path):
            problem[0] = f"--json {path}: it is a directory"
        elif not os.path.isdir(directory):
            problem[0] = f"--json {path}: the directory {directory} does not exist"
        elif not os.access(directory, os.W_OK):
            problem[0] = f"--json {path}: the directory {directory} is not writable"
    dist.broadcast_object_list(problem, src=0)
    return problem[0]


def main():
    args = parse_args()
    problem = config_problem(args)
    if problem:
        if RANK == 0:
            print(f"torch_fsdp2.py: {problem}", file=sys.stderr)
        return 1
    threads = args.threads or max(1, (os.cpu_count() or 1) // LOCAL_SIZE)
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://{args.master_addr}:{args.master_port}",
                            rank=RANK, world_size=WORLD)
    try:
        problem = json_problem(args.json)
        if problem:
            if RANK == 0:
                print(f"torch_fsdp2.py: {problem}", file=sys.stderr)
            return 1
        run(args, threads)
    finally:
        dist.destroy_process_group()
    return 0


def run(args, threads):
    keys = args.config
    meshes = build_meshes(keys)
    trainers = [Trainer(key, args, meshes) for key in keys]
    rounds = args.warmup + args.steps
    # One more round than timed, for counting collectives and probing memory.
    batches = [global_batch(args, r) for r in range(rounds + 1)]
    data = [[(t.share(x), t.share(y)) for x, y in batches] for t in trainers]

    step_s, phase_s = time_interleaved(trainers, data, args.warmup, args.steps)

    # Losses and persistent bytes now, after the last timed step.
    losses = torch.tensor([t.last_loss.item() / WORLD for t in trainers], dtype=torch.float64)
    dist.all_reduce(losses)
    persistent = [t.persistent() for t in trainers]
    reshard = {t.key: t.reshard_after_forward() for t in trainers if t.key in FSDP_CONFIGS}

    collectives = []
    for t, d in zip(trainers, data):
        if t.key == "torch-ddp":
            t.net.register_comm_hook(None, default_hooks.allreduce_hook)
        dist.barrier()
        with counting_collectives() as counts:
            t.step(*d[-1])
        collectives.append(f"{counts['AG']}/{counts['RS']}/{counts['AR']}")

    optimizer_impl = {t.key: t.optimizer_impl() for t in trainers}
    memory = []
    for key, d in zip(keys, data):
        memory.append(probe_memory(key, args, meshes, *d[-1]))
    mem = torch.tensor([list(p) + list(m) for p, m in zip(persistent, memory)], dtype=torch.int64)
    dist.all_reduce(mem, op=dist.ReduceOp.MAX)

    rows = []
    for i, key in enumerate(keys):
        params, grads, optimizer, held, peak = mem[i].tolist()
        phases = list(zip(*phase_s[i]))
        rows.append({
            "config": key,
            "step_ms": statistics.median(step_s[i]) * 1e3,
            "step_min_ms": min(step_s[i]) * 1e3,
            "step_max_ms": max(step_s[i]) * 1e3,
            "forward_ms": statistics.median(phases[0]) * 1e3,
            "backward_ms": statistics.median(phases[1]) * 1e3,
            "sync_ms": 0.0,
            "optimizer_ms": statistics.median(phases[2]) * 1e3,
            "persistent_bytes": params + grads + optimizer,
            "params_bytes": params,
            "grads_bytes": grads,
            "optimizer_bytes": optimizer,
            "held_bytes": held,
            "peak_bytes": peak,
            "collectives_per_step": collectives[i],
            "final_loss": losses[i].item(),
        })
    if RANK != 0:
        return

    meta = {
        "torch": torch.__version__,
        "backend": "gloo",
        "world_size": WORLD,
        "ranks_per_node": LOCAL_SIZE,
        "threads_per_rank": threads,
        "model": {"vocab": args.vocab, "hidden": args.hidden, "heads": args.heads,
                  "layers": args.layers, "ffn": ffn_dim(args.hidden), "seq": args.seq,
                  "tie_output": True},
        "global_batch": args.batch,
        "steps": args.steps,
        "warmup": args.warmup,
        "seed": args.seed,
        "lr": args.lr,
        "optimizer": "AdamW, PyTorch defaults (betas 0.9/0.999, eps 1e-8, weight_decay 0.01, "
                     "amsgrad off: LibTorch AdamWOptions' defaults)",
        "optimizer_impl": optimizer_impl,
        "param_dtype": args.param_dtype,
        "mixed_precision": (
            "FSDP2/HSDP configs: MixedPrecisionPolicy(param_dtype=bfloat16, "
            "reduce_dtype=float32); single and torch-ddp float32"
            if args.param_dtype == "bfloat16" else "none: float32 everywhere"),
        "reshard_after_forward": reshard,
        "memory_method": "held/peak: a fresh copy of each config built and run for two "
                         "steps under torch.profiler(profile_memory=True); live bytes rebuilt "
                         "from its CPU [memory] events (size, address); held = end of the "
                         "second step, peak = its maximum; blocks gloo frees on its worker "
                         "threads (unseen) taken as freed when the next gloo collective ends",
        "collectives_method": "Python-level torch.distributed calls in one extra untimed step; "
                              "torch-ddp: with DDP's allreduce_hook for that step",
    }
    spread = max(r["final_loss"] for r in rows) - min(r["final_loss"] for r in rows)
    doc = {
        "benchmark": "train-peer",
        "meta": meta,
        "columns": [{"key": k, "title": t, "unit": u} for k, t, u in COLUMNS],
        "rows": rows,
        "summary": {"final_loss_spread": spread},
    }
    print_table(meta, rows)
    print(f"# final loss spread across configs: {spread:.3g} (same seed and data)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
        print(f"# JSON written to {args.json}")


if __name__ == "__main__":
    code = main()
    # torch 2.15 may abort in interpreter teardown after gloo and the profiler
    # ran ("terminate called without an active exception": a C++ thread
    # destroyed while joinable; one rank in one of ~50 np 4 launches). The
    # report is written and the group destroyed, so skip the teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
