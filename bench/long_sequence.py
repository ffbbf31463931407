"""Longest sequence that trains one step under a fixed per-rank memory budget (issue 16), GPT d 512 on 1 rank.

    python bench/long_sequence.py                                   # budget 512 MiB, every system
    python bench/long_sequence.py --budget-mib 256 --systems dense,ac_chunked --max-len 4096   # smoke run
    python bench/long_sequence.py --sp 2 --systems dense,ac_chunked     # Ulysses: each system at sp=1 and sp=2
    python bench/long_sequence.py --model llama --systems dense,ac_chunked,ac_chunked_tiled   # HF Llama, rotary
    python bench/long_sequence.py --model llama --sp 2 --systems dense,ac_chunked   # HF Llama at sp=1 (dp=2) and sp=2
    python bench/long_sequence.py --position rotary --sp 2 --systems dense,ac_chunked   # the GPT with rotary positions
    python bench/long_sequence.py --model bamba --sp 2 --systems dense,ac_chunked   # HF Bamba (Mamba-2 + attention)
    python bench/long_sequence.py --model qwen3_5 --sp 2 --systems dense,ac_chunked   # Qwen 3.5 (gated DeltaNet)

Systems (one rank: a world-1 gloo group, the real ``parallelize()`` + engine path at ZeRO stage 0, AdamW, fp32):

* ``dense``          dense SDPA, no activation checkpointing, the unchunked loss (``loss_chunk=0``) -- the baseline
* ``ac``             + ``activation_checkpointing="full"`` (every block)
* ``ac_selective``   + ``activation_checkpointing="selective"`` (matmul / attention outputs kept)
* ``chunked``        + the chunked loss only (``loss_chunk=512``, the default)
* ``ac_chunked``     full checkpointing + the chunked loss
* ``sparse``         block-sparse attention (BSLongformer, block 64, window 3 blocks, global block 0), nothing else
* ``sparse_ac_chunked``  block-sparse + full checkpointing + the chunked loss
* ``ac_chunked_tiled`` / ``sparse_ac_chunked_tiled``  the same + the tiled MLP (``tiled_mlp=512``: each block's MLP
  and its norms run and recompute 512 positions at a time, lightning_scale.tiled_mlp; the MLP keeps the norm's
  input, not its output)
* ``ac_chunked_tiled_mlp_only``  the tiled MLP without the tiled norms (``tile_mlps(norms=False)``: the MLP keeps
  its own input; the norms run whole) -- the A/B of the norms' share
* ``ac_chunked_tiled256``  ``ac_chunked_tiled`` with 256-position tiles
* ``dense_offload`` / ``ac_chunked_tiled_offload``  ``dense`` / ``ac_chunked_tiled`` under ZeRO-Offload (stage 2,
  ``offload="optimizer"``; these rows ignore ``--stage``): Adam's state (and the gradient copies the step streams)
  are host memory, searched on the device bytes only (below)
* ``ac_chunked_tiled_offload_all``  ``ac_chunked_tiled`` under ZeRO-3 ``offload="all"`` (parameters and optimizer on
  the host, each unit gathered to the device for compute; ignores ``--stage``)
* ``..._act``  + activation offload (``offload_activations=True``): each checkpointed block's input waits on the host
  between its forward and its backward (forced on this CPU, where the offloader leaves CPU tensors in place; the host
  copies are counted as host bytes)
* ``ac_chunked_tiled_heads`` / ``ac_chunked_tiled_heads_offload_all_act``  + head-tiled attention
  (``tiled_attention=1``: each block's attention runs and recomputes one head at a time, lightning_scale.tiled_attention;
  at sp=N groups of N heads: one head per rank after the all-to-all)
* ``sparse_...``  the same with block-sparse attention (each head group runs its own heads' layout)

How memory is measured: ``lightning_scale.memory.LiveTensorBytes`` (a TorchDispatchMode) is active from building
the model to the end of the optimizer step; the figure is the peak of the live bytes of every tensor storage
created inside (parameters, the engine's buffers, activations, gradients, Adam state, the loss's logits), at op
granularity. Scratch memory an op frees inside its own kernel is not seen. A length *fits* when that peak is at
most the budget. Offload rows: the peak of the live bytes minus those of the tensors the engine keeps on the host
(``DeviceBytes`` / ``host_tensors``: the non-aliased fp32 masters, the host gradient copies, the optimizer state --
what its ``memory_bytes()['host']`` counts); the parameters, the gradient buffer and every activation count as
device. On this CPU-only machine host and device are the same RAM: the row says what an accelerator would hold,
not what this process held (both printed per probe). The search doubles the length from ``--start`` while it fits, then bisects to ``--granularity``
positions; every probe is a real training step (batch 1). Step times are at the baseline's longest length (and
at each system's own longest). This machine has no accelerator; ``bench/gpu_long_sequence.py`` is the GPU version.

``--sp N`` (Ulysses sequence parallelism, issue 16 item 3): N gloo ranks on this machine; every system is searched
twice in the same run, at sp=1 (dp=N replicas, batch 1 each: per rank exactly what one rank holds at ZeRO 0) and at
sp=N (one sequence over the N ranks, each holding L/N positions). The length reported is the whole sequence; the
budget holds for every rank (the peak is the maximum over ranks). Model states are replicated at ZeRO stage 0 (the
search's stage; ``--stage 3`` shards them over dp x sp), so only the activations and the logits shrink with sp.
``--sp N --peer-rounds R`` then times R interleaved training steps (median) at the dense baseline's longest length
at sp=N: lightning_scale's all-to-all against DeepSpeed's Ulysses ``deepspeed.sequence.layer.DistributedAttention``
around the same SDPA core in the same model (positions, loss and engine are lightning_scale's in both; only the
attention's all-to-alls differ). DeepSpeed must be importable (``DS_ACCELERATOR=cpu``); else the row says so. The
project's environment has no DeepSpeed; bench/RESULTS.md says how it was installed for the recorded run (a venv).

``--sp N --tp T``: N x T ranks; every row is tensor-parallel (tp=T: heads, MLP and vocabulary split; each rank builds
its slices on meta), searched at dp=N and at sp=N (Ulysses over the tp-local heads, H / (T x N) per rank). With
``--model llama|bamba|qwen3_5`` the Hugging Face model is split by its built-in tp plan (a hybrid's recurrent layers
too: sp then cuts each tp rank's share of them over the sp ranks).

``--check-peers``: whether torch's own tools take a training step here (FlexAttention with a block mask; with --sp
its ``context_parallel`` ring attention over the sp group). On torch 2.13's CPU build neither does (FlexAttention:
"does not support backward on CPU"; context_parallel: no sharding strategy for the CPU flash-attention op), so they
have no rows; the messages are printed.

Not a test: prints a table; nothing asserts.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
from typing import Dict, Optional, Tuple

# appended, not prepended: the repository root holds a `kernels/` folder that would shadow the PyPI `kernels`
# package transformers imports (HF Llama rows)
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("LIGHTNING_SCALE_SKIP_REGISTER", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from lightning_scale.config import from_flat_kwargs  # noqa: E402
from lightning_scale.memory import LiveTensorBytes  # noqa: E402
from lightning_scale.models.gpt import GPT, GPTConfig  # noqa: E402
from lightning_scale.parallelize import local_topology, parallelize  # noqa: E402
from lightning_scale.sequence_parallel import shard_sequence  # noqa: E402

MiB = 2**20
SYSTEMS: Dict[str, dict] = {  # name -> (strategy options, loss_chunk, sparse)
    "dense": dict(ac=None, chunk=0, sparse=False),
    "ac": dict(ac="full", chunk=0, sparse=False),
    "ac_selective": dict(ac="selective", chunk=0, sparse=False),
    "chunked": dict(ac=None, chunk=512, sparse=False),
    "ac_chunked": dict(ac="full", chunk=512, sparse=False),
    "sparse": dict(ac=None, chunk=0, sparse=True),
    "sparse_ac_chunked": dict(ac="full", chunk=512, sparse=True),
    "ac_chunked_tiled": dict(ac="full", chunk=512, sparse=False, tiled=512),
    "ac_chunked_tiled_mlp_only": dict(ac="full", chunk=512, sparse=False, tiled=512, norms=False),
    "ac_chunked_tiled256": dict(ac="full", chunk=512, sparse=False, tiled=256),
    "sparse_ac_chunked_tiled": dict(ac="full", chunk=512, sparse=True, tiled=512),
    # ZeRO-Offload (stage 2, offload="optimizer"): the fp32 masters, their gradient copies and Adam's state live on
    # the host; the length is searched on the *device* bytes (see DeviceBytes)
    "dense_offload": dict(ac=None, chunk=0, sparse=False, stage=2, offload="optimizer"),
    "ac_chunked_tiled_offload": dict(ac="full", chunk=512, sparse=False, tiled=512, stage=2, offload="optimizer"),
    # ZeRO-3 + offload="all" (parameters and optimizer on the host; each unit gathered to the device for compute)
    "ac_chunked_tiled_offload_all": dict(ac="full", chunk=512, sparse=False, tiled=512, stage=3, offload="all"),
    # + activation offload (offload_activations=True): each checkpointed block's input waits on the host between
    # its forward and its backward (forced on this CPU, where the offloader would otherwise leave CPU tensors be)
    "ac_chunked_tiled_offload_all_act": dict(ac="full", chunk=512, sparse=False, tiled=512, stage=3, offload="all",
                                             act=True),
    # + head-tiled attention (tiled_attention=1: each block's attention runs and recomputes one head at a time)
    "ac_chunked_tiled_heads": dict(ac="full", chunk=512, sparse=False, tiled=512, heads=1),
    "ac_chunked_tiled_heads_offload_all_act": dict(ac="full", chunk=512, sparse=False, tiled=512, heads=1, stage=3,
                                                   offload="all", act=True),
    "sparse_ac_chunked_tiled_heads_offload_all_act": dict(ac="full", chunk=512, sparse=True, tiled=512, heads=1,
                                                          stage=3, offload="all", act=True),
    "sparse_ac_chunked_tiled_offload_all_act": dict(ac="full", chunk=512, sparse=True, tiled=512, stage=3,
                                                    offload="all", act=True),
}


class DeviceBytes(LiveTensorBytes):
    """``LiveTensorBytes`` that also keeps the peak of the bytes an accelerator would hold: all live bytes minus
    those of ``host_fn()``'s tensors (the offloaded engine's host side). On this CPU both are the same RAM; the
    split is the engine's own (``memory_bytes()['host']``: fp32 masters, gradient copies, optimizer state), as
    bench/max_model.py accounts it. Without ``host_fn`` the device peak is the peak."""

    def __init__(self) -> None:
        super().__init__()
        self.host_fn = None
        self.device_peak = self.host_peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        host = 0
        if self.host_fn is not None:
            keys = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in self.host_fn()}
            host = sum(n for k, n in keys.items() if k in self._live)
        self.device_peak = max(self.device_peak, self.current - host)
        self.host_peak = max(self.host_peak, host)
        return out


def host_tensors(engine):
    """The tensors an offload engine keeps on the host (what its ``memory_bytes()['host']`` counts): stages 1-2
    (ZeroOptimizer) the non-aliased masters, the host gradient copies and the optimizer state; stage 3
    (Stage3Optimizer) also the gradient shards streamed to the host and, under parameter offload, the parameter
    shards (a unit gathered from them for compute is a new, device, buffer)."""
    offload_opt = getattr(engine, "offload_optimizer", False)
    sharded = getattr(engine, "sharded", None)
    offload_params = bool(getattr(sharded, "params_offloaded", False))
    if not (offload_opt or offload_params):
        return []
    out = []
    if offload_opt:
        out += [m for m, aliased in zip(engine.masters, engine._aliased) if not aliased]
        out += [v for state in engine.inner.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    for st in engine.reducer.states:
        if getattr(st, "host_grad", None) is not None:
            out.append(st.host_grad)
        if getattr(st, "grad_shard", None) is not None and getattr(st, "grad_device", None) is not None:
            out.append(st.grad_shard)
        if offload_params:
            out.append(st.shard)
    return out


def activation_host_tensors(offloader):
    """The block inputs an activation offloader holds on the host (offload_activations rows)."""
    if offloader is None:
        return []
    return [h for entry in offloader.host.values() for h, _ in entry]


def model_config(args, length: int, chunk: int) -> GPTConfig:
    return GPTConfig(vocab_size=args.vocab, seq_len=length, n_layer=args.layers, n_head=args.heads, d_model=512,
                     loss_chunk=chunk, position=args.position)


def one_step(args, name: str, length: int, topo) -> Tuple[int, float]:
    """(peak live bytes, seconds) of building the model and training one step at ``length`` (with sp > 1: the
    most any rank held, and rank 0's time)."""
    spec = SYSTEMS[name]
    import lightning_scale.tiled_mlp as tiled

    tiled.TILE_NORMS = spec.get("norms", True)  # tile_mlps' default, read when parallelize() tiles
    if args.model in ("llama", "bamba", "qwen3_5"):
        return _llama_step(args, spec, length, topo)
    config = from_flat_kwargs(stage=spec.get("stage", args.stage), activation_checkpointing=spec["ac"], sp=topo.sp,
                              tp=topo.tp, tiled_mlp=spec.get("tiled", 0), offload=spec.get("offload", "none"),
                              offload_activations=spec.get("act", False), tiled_attention=spec.get("heads", 0) * topo.sp)
    cfg = model_config(args, length, spec["chunk"])
    torch.manual_seed(0)
    with DeviceBytes() as mem:
        if topo.tp > 1:  # on meta: each rank allocates only its tp slices (as the Trainer's meta init does)
            with torch.device("meta"):
                model = GPT(cfg)
        else:
            model = GPT(cfg)
        if spec["sparse"]:
            from lightning_scale.nn import BSLongformerSparsityConfig, swap_gpt_attention

            swap_gpt_attention(model, BSLongformerSparsityConfig(num_heads=args.heads, block=64,
                                                                 num_sliding_window_blocks=3,
                                                                 global_block_indices=(0,)))
        pm = parallelize(model, config, topo, "cpu", optimizers=lambda m=model: [torch.optim.AdamW(m.parameters())])
        (engine,) = pm.make_engines()
        offloader = getattr(model.blocks[0], "_ac_offloader", None)
        if offloader is not None:
            offloader.force = True  # a CPU run: copy the block inputs into separate (host) buffers anyway
        mem.host_fn = lambda e=engine, o=offloader: host_tensors(e) + activation_host_tensors(o)
        idx = torch.randint(0, cfg.vocab_size, (1, length + 1), generator=torch.Generator().manual_seed(length))
        x, y = shard_sequence((idx[:, :-1], idx[:, 1:]), topo.sp_rank, topo.sp)  # this rank's L / sp positions
        start = time.perf_counter()
        model.loss(x, y).backward()
        engine.step()
        engine.zero_grad()
        seconds = time.perf_counter() - start
        if spec.get("offload") or spec.get("act"):
            reported = engine.memory_bytes()["host"]
            HOST[(name, length)] = (mem.host_peak, reported, mem.peak)
        engine.remove_hooks()
        mem.host_fn = None
        del engine, pm, model
    if dist.get_world_size() > 1:
        peak = torch.tensor([float(mem.device_peak)], dtype=torch.float64)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        return int(peak.item()), seconds
    return mem.device_peak, seconds


HOST: Dict[Tuple[str, int], Tuple[int, int, int]] = {}  # offload rows: (host peak, engine's host bytes, all bytes)


def _llama(args, length: int):
    """An unchanged Hugging Face LlamaForCausalLM of the bench GPT's width (rotary positions: no table that grows
    with L; SwiGLU MLP of 4 x d; sdpa), fp32. ``--model bamba``: BambaForCausalLM of that width instead, a hybrid
    (Mamba-2 layers with one group of B / C, as its releases, 16 heads of 64; attention in the middle layer; under sp
    each mixer gathers the sequence and runs its 1 / sp of the heads, sequence_parallel/mamba.py)."""
    if args.model == "qwen3_5":  # Qwen 3.5 dense: gated DeltaNet layers, full attention every 4th (as its releases)
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

        types = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
        cfg = Qwen3_5TextConfig(vocab_size=args.vocab, hidden_size=512, intermediate_size=2048,
                                num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                num_key_value_heads=2, head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8,
                                linear_key_head_dim=64, linear_value_head_dim=64,
                                layer_types=(types * args.layers)[:args.layers - 1] + ["full_attention"],
                                max_position_embeddings=length, attn_implementation="sdpa", use_cache=False)
        return Qwen3_5ForCausalLM(cfg)
    if args.model == "bamba":
        from transformers import BambaConfig, BambaForCausalLM

        cfg = BambaConfig(vocab_size=args.vocab, hidden_size=512, intermediate_size=2048,
                          num_hidden_layers=args.layers, num_attention_heads=args.heads,
                          num_key_value_heads=args.heads, mamba_n_heads=16, mamba_d_head=64, mamba_n_groups=1,
                          mamba_d_state=64, mamba_chunk_size=256, attn_layer_indices=[args.layers // 2],
                          max_position_embeddings=length, attn_implementation="sdpa", use_cache=False)
        return BambaForCausalLM(cfg)
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=512, intermediate_size=2048, num_hidden_layers=args.layers,
                      num_attention_heads=args.heads, num_key_value_heads=args.heads, max_position_embeddings=length,
                      attn_implementation="sdpa", use_cache=False)
    return LlamaForCausalLM(cfg)


def _llama_step(args, spec: dict, length: int, topo) -> Tuple[int, float]:
    """one_step for ``--model llama``: the cross-entropy of the full logits without chunking, else the final hidden
    states through ``lightning_scale.nn.chunked_loss.chunked_cross_entropy`` with the model's ``lm_head``; at sp > 1
    each rank's slice (the sequence-parallel model gives its positions their global ids), the mean over the whole
    sequence through ``sequence_mean``."""
    from lightning_scale.nn.chunked_loss import chunked_cross_entropy

    if spec["sparse"]:
        raise SystemExit(f"--model {args.model}: the sparse systems are GPT-only in this bench")
    config = from_flat_kwargs(stage=args.stage, activation_checkpointing=spec["ac"], tiled_mlp=spec.get("tiled", 0),
                              sp=topo.sp, tp=topo.tp, tiled_attention=spec.get("heads", 0) * topo.sp)  # a group per sp rank
    torch.manual_seed(0)
    with LiveTensorBytes() as mem:
        if topo.tp > 1:  # parameters on meta: each rank allocates only its tp slices (the Trainer's meta init)
            from lightning_scale.materialize import parameters_on_meta

            with parameters_on_meta():
                model = _llama(args, length)
        else:
            model = _llama(args, length)
        pm = parallelize(model, config, topo, "cpu", optimizers=lambda m=model: [torch.optim.AdamW(m.parameters())])
        (engine,) = pm.make_engines()
        idx = torch.randint(0, args.vocab, (1, length + 1), generator=torch.Generator().manual_seed(length))
        # sp > 1: this rank's L / sp positions (the sequence-parallel model gives them their global position ids)
        x, y = shard_sequence((idx[:, :-1], idx[:, 1:]), topo.sp_rank, topo.sp)
        start = time.perf_counter()
        if spec["chunk"]:  # no local name for the hidden states: they would outlive their use through backward
            loss = chunked_cross_entropy(model.model(input_ids=x).last_hidden_state, model.lm_head, y,
                                         chunk_size=spec["chunk"])
        else:
            logits = model(input_ids=x).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
        if topo.sp > 1:  # the whole sequence's mean (equal slices): the slices' summed losses over sp / L
            from lightning_scale.sequence_parallel.ulysses import sequence_mean

            loss = sequence_mean(loss * y.numel(), torch.tensor(float(y.numel()), dtype=torch.float64),
                                 topo.sp_group)
        loss.backward()
        engine.step()
        engine.zero_grad()
        seconds = time.perf_counter() - start
        engine.remove_hooks()
        del engine, pm, model, loss
    if dist.get_world_size() > 1:  # every rank probes the same lengths: the largest peak decides
        peak = torch.tensor([float(mem.peak)], dtype=torch.float64)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        return int(peak.item()), seconds
    return mem.peak, seconds


def longest(args, row: str, name: str, topo, cache: Dict[Tuple[str, int], Tuple[int, float]]
            ) -> Tuple[int, Optional[int]]:
    """(longest fitting length, the first failing length probed) on the --granularity grid. Every rank searches the
    same lengths (the peaks are reduced over ranks), so the collectives stay in step."""
    budget = args.budget_mib * MiB

    def fits(length: int) -> bool:
        if (row, length) not in cache:
            cache[(row, length)] = one_step(args, name, length, topo)
            peak, sec = cache[(row, length)]
            host = HOST.get((name, length))
            extra = (f" (host {host[0] / MiB:.1f} MiB, engine's memory_bytes host {host[1] / MiB:.1f}; device + "
                     f"host peak {host[2] / MiB:.1f})" if host else "")
            say(f"  {row:22s} L={length:6d}: peak {peak / MiB:7.1f} MiB{extra}, step {sec:6.2f} s "
                f"{'fits' if peak <= budget else 'over'}")
        return cache[(row, length)][0] <= budget

    good, bad, length = 0, None, args.start
    while length <= args.max_len and fits(length):
        good, length = length, length * 2
    if length <= args.max_len:
        bad = length
    elif good:
        return good, None  # still fits at --max-len: a lower bound
    if good == 0:
        return 0, bad
    while bad - good > args.granularity:
        mid = (good + bad) // 2 // args.granularity * args.granularity
        if mid in (good, bad):
            break
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return good, bad


def say(*parts) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*parts, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budget-mib", type=float, default=512)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--model", choices=("gpt", "llama", "bamba", "qwen3_5"), default="gpt",
                    help="llama: an unchanged HF LlamaForCausalLM of the same width (rotary positions); bamba: an "
                         "unchanged HF BambaForCausalLM (Mamba-2 + attention); qwen3_5: Qwen 3.5 dense (gated "
                         "DeltaNet + attention); with --sp")
    ap.add_argument("--position", choices=("learned", "rotary"), default="learned",
                    help="the GPT's positions: its learned table (grows with L) or rotary (GPTConfig(position=...))")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--start", type=int, default=512)
    ap.add_argument("--granularity", type=int, default=256)
    ap.add_argument("--max-len", type=int, default=32768)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sp", type=int, default=1, help="N > 1: N ranks, every system at sp=1 (dp=N) and sp=N")
    ap.add_argument("--stage", type=int, default=0, help="ZeRO stage of every system (3: states over dp x sp)")
    ap.add_argument("--tp", type=int, default=1, help="T > 1 (with --sp N): N x T ranks, every system at tp=T "
                    "(dp=N) and at tp=T x sp=N")
    ap.add_argument("--peer-rounds", type=int, default=0, help="with --sp: step-time rounds vs DeepSpeed Ulysses")
    ap.add_argument("--peer-length", type=int, default=0, help="with --peer-rounds: this length, no search")
    ap.add_argument("--check-peers", action="store_true", help="first try torch's FlexAttention and (with --sp) "
                    "context_parallel for one training step each and say whether they ran")
    args = ap.parse_args()
    names = [s for s in args.systems.split(",") if s]
    unknown = [s for s in names if s not in SYSTEMS]
    if unknown:
        raise SystemExit(f"unknown systems {unknown}; known: {', '.join(SYSTEMS)}")
    store = os.path.join(tempfile.mkdtemp(prefix="ls_longseq_"), "store")
    if args.sp * args.tp == 1:
        run(0, args, names, store)
    else:
        import torch.multiprocessing as mp

        mp.spawn(run, args=(args, names, store), nprocs=args.sp * args.tp)


def run(rank: int, args, names, store: str) -> None:
    world, sp, tp = args.sp * args.tp, args.sp, args.tp
    torch.set_num_threads(max(1, args.threads // world))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    if sp > 1:
        sp_topo = local_topology(from_flat_kwargs(stage=args.stage, sp=sp, tp=tp), world, rank)
        names = [n for name in names for n in (name, f"sp{sp}_{name}")]
    topo = local_topology(from_flat_kwargs(stage=args.stage, tp=tp), world, rank)  # tp > 1: tp=T at dp=sp
    topo_of = lambda name: sp_topo if name.startswith("sp") and sp > 1 else topo  # noqa: E731
    spec_of = lambda name: name.split("_", 1)[1] if name.startswith("sp") and sp > 1 else name  # noqa: E731
    say(f"# long_sequence: {f'GPT ({args.position} positions)' if args.model == 'gpt' else 'HF ' + args.model.capitalize()} d512 x {args.layers} layers, {args.heads} heads, vocab {args.vocab}, fp32, batch 1, "
        f"AdamW, ZeRO {args.stage}, {world} rank(s){f', tp={tp} in every row' if tp > 1 else ''}; budget {args.budget_mib:.0f} MiB of live tensor bytes per rank; "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} CPUs")
    if args.check_peers:
        check_torch_peers(sp_topo.sp_group if sp > 1 else None)
    if sp > 1 and args.peer_length:
        compare_deepspeed(args, args.peer_length, sp_topo)
        dist.destroy_process_group()
        return
    cache: Dict[Tuple[str, int], Tuple[int, float]] = {}
    found = {name: longest(args, name, spec_of(name), topo_of(name), cache) for name in names}
    base = found.get("dense", (0, None))[0] if "dense" in found else None
    if base:  # every system's step time at the baseline's length, measured in this run
        for name in names:
            if (name, base) not in cache and found[name][0] >= base:
                cache[(name, base)] = one_step(args, spec_of(name), base, topo_of(name))
    say()
    say(f"| system | longest L (budget {args.budget_mib:.0f} MiB) | x dense | x sp=1 | peak MiB at longest | "
        f"step s at longest | step s at dense's L={base} | x dense time |")
    say("|---|---|---|---|---|---|---|---|")
    for name in names:
        good, bad = found[name]
        bound = "" if bad is not None else " (>=, --max-len)"
        peak, sec = cache.get((name, good), (0, float("nan")))
        ratio = f"{good / base:.2f}" if base else "-"
        at_base = cache.get((name, base)) if base else None
        t_base = f"{at_base[1]:.2f}" if at_base else "-"
        t_ratio = f"{at_base[1] / cache[('dense', base)][1]:.2f}" if at_base and ("dense", base) in cache else "-"
        one = found.get(spec_of(name), (0, None))[0] if name != spec_of(name) else 0
        sp_ratio = f"{good / one:.2f}" if one else "-"
        say(f"| {name} | {good}{bound} | {ratio} | {sp_ratio} | {peak / MiB:.0f} | {sec:.2f} | {t_base} | {t_ratio} |")
    if sp > 1 and args.peer_rounds and base:
        compare_deepspeed(args, base, sp_topo)
    dist.destroy_process_group()


def check_torch_peers(group) -> None:
    """Can torch's own long-sequence tools train a step here? FlexAttention with a causal block mask (compiled) and
    ``torch.distributed.tensor.experimental.context_parallel`` (ring attention) over ``group`` (None: skipped).
    Prints what ran or the exception each raised; measured rows need a training step, so a peer that cannot take a
    backward on this CPU gets no row."""
    import torch.nn.functional as F

    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        length = 256
        mask = create_block_mask(lambda b, h, q, kv: q >= kv, 1, 1, length, length, device="cpu")
        q, k, v = (torch.randn(1, 2, length, 32, requires_grad=True) for _ in range(3))
        torch.compile(flex_attention)(q, k, v, block_mask=mask).sum().backward()
        say("torch FlexAttention (block mask, compiled): forward + backward ran")
    except Exception as err:  # noqa: BLE001 (report any failure: the peer cannot train here)
        say(f"torch FlexAttention (block mask, compiled): no training step on this CPU ({type(err).__name__}: "
            f"{str(err)[:160]})")
    if group is None:
        return
    try:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor.experimental import context_parallel

        mesh = DeviceMesh.from_group(group, "cpu")
        lin = torch.nn.Linear(32, 96)
        x = torch.randn(1, 64, 32)
        with context_parallel(mesh, buffers=[x], buffer_seq_dims=[1]):
            q, k, v = lin(x).view(1, -1, 3, 1, 32).permute(2, 0, 3, 1, 4)
            F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        say("torch context_parallel (ring attention) on gloo: forward + backward ran")
    except Exception as err:  # noqa: BLE001
        say(f"torch context_parallel (ring attention) on gloo: no training step on this CPU ({type(err).__name__}: "
            f"{str(err)[:160]})")


def deepspeed_cores(model, group) -> None:
    """Every GPT attention core through DeepSpeed's Ulysses DistributedAttention instead of ours (same SDPA)."""
    from deepspeed.sequence.layer import DistributedAttention

    def local(q, k, v, *a, **kw):  # DeepSpeed hands (B, L, H/sp, D); the core takes (B, H, L, D)
        out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                               is_causal=True)
        return out.transpose(1, 2)

    ulysses = DistributedAttention(local, group, scatter_idx=2, gather_idx=1)
    for block in model.blocks:
        def forward(q, k, v, ulysses=ulysses):  # (B, H, L/sp, D) -> (B, L/sp, H, D) -> DeepSpeed -> (B, H, L/sp, D)
            return ulysses(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0).transpose(1, 2)
        block.attn.core.forward = forward


def compare_deepspeed(args, length: int, topo) -> None:
    try:
        import deepspeed.sequence.layer  # noqa: F401
    except Exception as err:  # noqa: BLE001 (any import failure: the peer cannot run here)
        say(f"\nDeepSpeed Ulysses DistributedAttention: not run ({type(err).__name__}: {err})")
        return
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")  # wraps the process group that exists already
    times: Dict[str, list] = {"lightning_scale": [], "deepspeed": []}
    for r in range(-1, args.peer_rounds):  # round -1: warm-up, not counted
        for who in (list(times) if r % 2 == 0 else list(times)[::-1]):
            config = from_flat_kwargs(stage=args.stage, sp=topo.sp)
            torch.manual_seed(0)
            model = GPT(model_config(args, length, 512))
            pm = parallelize(model, config, topo, "cpu", optimizers=lambda m=model: [torch.optim.AdamW(m.parameters())])
            if who == "deepspeed":
                deepspeed_cores(model, topo.sp_group)
            (engine,) = pm.make_engines()
            idx = torch.randint(0, args.vocab, (1, length + 1), generator=torch.Generator().manual_seed(length))
            x, y = shard_sequence((idx[:, :-1], idx[:, 1:]), topo.sp_rank, topo.sp)
            dist.barrier()
            start = time.perf_counter()
            loss = model.loss(x, y)
            loss.backward()
            engine.step()
            engine.zero_grad()
            t = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if r >= 0:
                times[who].append(float(t))
            say(f"  round {r} {who:16s} L={length} sp={topo.sp}: loss {float(loss.detach()):.6f}, "
                f"step {float(t):.2f} s")
            engine.remove_hooks()
    med = {k: statistics.median(v) for k, v in times.items()}
    say(f"\n| sp={topo.sp}, L={length}, {args.peer_rounds} rounds | median step s | tokens/s | "
        f"x DeepSpeed |")
    say("|---|---|---|---|")
    for who, t in med.items():
        say(f"| {who} (DeepSpeed {deepspeed.__version__}) | {t:.2f} | {length / t:.0f} | {med['deepspeed'] / t:.2f} |"
            if who == "deepspeed" else f"| {who} | {t:.2f} | {length / t:.0f} | {med['deepspeed'] / t:.2f} |")



if __name__ == "__main__":
    main()
