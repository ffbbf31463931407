"""Surviving a lost rank under real torchrun (issue 15 item 6; docs/failures.md "Restart recipes").

fit_restart.py trains the tiny GPT at ZeRO-2 for 8 steps (a checkpoint at every 2-step epoch end, last.ckpt,
``fit(ckpt_path="last")``). The reference is the same job uninterrupted (run_script's forked ranks). Under
``torchrun --max-restarts=1`` rank 1 SIGKILLs itself at step 5: torchelastic restarts both ranks, which resume from
the step-4 checkpoint and must give the reference's losses for steps 4-7.

The same script also runs an elastic two-agent job that loses a node and goes on at world size 1 from its universal
checkpoint, and async saves with save_top_k=1 + save_last=True killed in the middle of a last.ckpt write.

What this caught (both fixed in the library): the restarted ranks read the killed attempt's gloo addresses from
torchrun's shared store and failed in connectFullMesh (lightning_scale.diagnostics.elastic), and Lightning resumed an
iteration-based run from an epoch-end checkpoint one batch off (strategies.checkpoint.resume_epoch_end_as_last_batch).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time

import pytest
import torch

from lightning_scale.testing import run_script

SCRIPT = os.path.join(os.path.dirname(__file__), "fit_restart.py")


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _kill_leftovers(pid_dir):
    """torchelastic starts every worker in a session of its own: kill each one's group, and say who was alive."""
    alive = []
    for name in sorted(os.listdir(pid_dir)):
        pid = int((pid_dir / name).read_text())
        try:
            os.killpg(pid, signal.SIGKILL)
            alive.append(name)
        except (ProcessLookupError, PermissionError):
            pass
    return alive


def torchrun(tmp, name, *args, nproc=2, max_restarts=1, timeout=240):
    """One real ``python -m torch.distributed.run`` job of fit_restart.py; returns (returncode, output, out lines).
    run_script kills torchrun's process group on timeout; the workers (sessions of their own) by their pid files."""
    out, pid_dir = tmp / f"{name}.jsonl", tmp / f"{name}.pids"
    pid_dir.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           f"--max-restarts={max_restarts}", "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0",
           SCRIPT, "--out", str(out), "--pid-dir", str(pid_dir), *args]
    try:
        proc = run_script(cmd, timeout=timeout, cwd=tmp, merge_stderr=True)
    finally:
        left = _kill_leftovers(pid_dir)
    assert not left, f"worker processes left after torchrun ended: {left}"
    return proc.returncode, proc.stdout, _lines(out)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted 2-rank job: losses of steps 0-7 (keys are the global steps, as JSON strings)."""
    tmp = tmp_path_factory.mktemp("restart_ref")
    out = tmp / "ref.jsonl"
    proc = run_script([sys.executable, SCRIPT, "--out", str(out), "--ckpt-dir", str(tmp / "ckpt")], timeout=240,
                      cwd=tmp, ranks=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    (run,) = _lines(out)
    assert run["start_step"] == 0 and sorted(run["losses"], key=int) == [str(s) for s in range(8)]
    return run["losses"]


@pytest.mark.slow  # two torchrun attempts of 2 Lightning ranks: 35-54 s on the loaded 2-core box
def test_torchrun_restarts_a_killed_rank_from_the_last_checkpoint(tmp_path, reference):
    rc, output, runs = torchrun(tmp_path, "restart", "--ckpt-dir", str(tmp_path / "ckpt"),
                                "--kill-once", str(tmp_path / "killed"), "--kill-at", "5", "--stagger", "3")
    assert rc == 0, output[-6000:]
    assert (tmp_path / "killed").exists()  # attempt 0 did lose rank 1 at step 5
    assert "rank 1" in output and "was killed by a signal" in output  # the survivor said so before the restart
    (run,) = runs  # attempt 0's rank 0 never finished
    assert run["attempt"] == 1 and run["world"] == 2
    assert run["start_step"] == 4 and run["global_step"] == 8  # from the step-4 checkpoint, not from scratch
    assert run["losses"] == {s: reference[s] for s in ("4", "5", "6", "7")}, (run["losses"], reference)
    names = sorted(os.listdir(tmp_path / "ckpt"))
    assert names == ["epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt", "epoch=2-step=6.ckpt", "epoch=3-step=8.ckpt",
                     "last.ckpt"], names  # the epochs count on as uninterrupted; nothing half-written left


def elastic_agents(tmp, name, *args, nodes=2, nnodes=None, timeout=240):
    """``nodes`` torchrun agents on this host, one rank each, in one elastic c10d rendezvous (``--nnodes=1:nodes``,
    or ``nnodes`` as given, as on ``nodes`` machines); the rendezvous store is hosted here (``is_host=false`` for
    every agent), as a head node or etcd would, so that losing any agent leaves it; a lost agent is declared dead
    after 4 missed 1 s keep-alives (torch's default, 3 x 5 s, held the survivor's re-rendezvous 16 s). Returns (the
    agents' return codes, their output, out lines); kills every agent's and worker's session at the end."""
    import subprocess

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True, wait_for_workers=False)
    out, pid_dir = tmp / f"{name}.jsonl", tmp / f"{name}.pids"
    pid_dir.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes or f'1:{nodes}'}", "--nproc-per-node=1",
           "--max-restarts=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{store.port}", f"--rdzv-id={name}",
           "--rdzv-conf=is_host=false,last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=4", SCRIPT, "--out", str(out), "--pid-dir", str(pid_dir),
           *args]
    env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")  # the multi-host recipe (docs/failures.md)
    agents = [subprocess.Popen(cmd, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True) for _ in range(nodes)]
    deadline = time.monotonic() + timeout
    try:
        output = [a.communicate(timeout=max(1.0, deadline - time.monotonic()))[0] for a in agents]
    finally:
        for a in agents:
            try:
                os.killpg(a.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            a.wait()
        left = _kill_leftovers(pid_dir)
    assert not left, f"worker processes left after the agents ended: {left}"
    return [a.returncode for a in agents], "\n".join(output), _lines(out)


@pytest.mark.slow  # two torchrun agents, two attempts of 2 ranks: 40-90 s on the loaded box
def test_two_node_torchrun_restarts_a_killed_rank_from_the_last_checkpoint(tmp_path, reference):
    """Multi-host restart, emulated: two torchrun agents (``--nnodes=2 --nproc-per-node=1``, two "nodes" of one rank
    each, the multi-host recipe's TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, the rendezvous store hosted by the test).
    Rank 1 SIGKILLs itself (not its agent) at step 5: its agent restarts it, the other agent's rank reports the loss
    and fails (or is restarted by the re-rendezvous), both agents meet again at world size 2 and the ranks resume
    the step-4 checkpoint with the uninterrupted run's losses bit for bit; both agents end 0, no process is left."""
    codes, output, runs = elastic_agents(tmp_path, "two_nodes", "--ckpt-dir", str(tmp_path / "ckpt"),
                                         "--kill-once", str(tmp_path / "killed"), "--kill-at", "5", nnodes="2")
    assert codes == [0, 0], output[-6000:]
    assert (tmp_path / "killed").exists()
    assert "rank 1" in output and "was killed by a signal" in output, output[-6000:]  # the survivor said so
    # the agents' restart counts differ (rank 0's agent was restarted by the re-rendezvous): the watchdogs must
    # still share one namespace (rank 0 waited its whole stop_timeout for rank 1's end when they did not)
    assert "not every rank reached the end" not in output, output[-6000:]
    (run,) = runs  # attempt 0's rank 0 never finished
    assert run["world"] == 2 and run["start_step"] == 4 and run["global_step"] == 8, run
    assert run["losses"] == {s: reference[s] for s in ("4", "5", "6", "7")}, (run["losses"], reference)
    print(f"two-node restart: rank 0's agent attempt {run['attempt']} (an agent restarted by the re-rendezvous, "
          "not by its own worker's failure, does not count it)")


@pytest.mark.slow  # two torchrun agents, a re-rendezvous and a 1-rank reference: 40-60 s on the loaded box
def test_elastic_restart_on_fewer_nodes_resumes_the_universal_checkpoint(tmp_path, reference):
    """torchrun shrinks the world at node granularity: two agents (two "nodes" of one rank each, ``--nnodes=1:2``)
    train in the universal format; at step 5 rank 1 SIGKILLs its agent and itself (a lost node). The surviving
    agent's rank fails, it restarts and meets the rendezvous alone: world size 1, ``fit(ckpt_path="last")`` resumes
    the step-4 checkpoint written by dp=2. Its losses equal a 1-rank run started from that same checkpoint, and the
    uninterrupted 2-rank run's within 1e-5 (the dp=2 -> 1 reduction order)."""
    from lightning_scale.checkpoint import dcp_format

    ckpt = tmp_path / "ckpt"
    codes, output, runs = elastic_agents(tmp_path, "shrink", "--ckpt-dir", str(ckpt), "--format", "universal",
                                         "--kill-once", str(tmp_path / "killed"), "--kill-at", "5", "--kill-agent",
                                         "--wait-for-world", "2")
    assert sorted(codes) == [-signal.SIGKILL, 0], output[-6000:]  # the lost node's agent; the survivor finished
    (run,) = runs
    assert run["attempt"] == 1 and run["world"] == 1 and run["start_step"] == 4 and run["global_step"] == 8, run
    step4 = ckpt / "epoch=1-step=4.ckpt"  # written by the 2-rank attempt, kept (the restart saved steps 6 and 8)
    assert dcp_format.open_checkpoint(str(step4))[1]["layout"]["world_size"] == 2
    same = tmp_path / "same_state"
    same.mkdir()
    shutil.copytree(step4, same / "last.ckpt")
    out = tmp_path / "same_state.jsonl"
    proc = run_script([sys.executable, SCRIPT, "--out", str(out), "--ckpt-dir", str(same), "--format", "universal"],
                      timeout=240, cwd=tmp_path, ranks=1)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    (one,) = _lines(out)
    assert one["world"] == 1 and one["start_step"] == 4
    assert run["losses"] == one["losses"], (run["losses"], one["losses"])
    diff = max(abs(run["losses"][s] - reference[s]) for s in ("4", "5", "6", "7"))
    print(f"elastic 1-rank continuation vs the uninterrupted 2-rank run: max |loss diff| {diff:.2e}")
    assert sorted(run["losses"], key=int) == ["4", "5", "6", "7"] and diff <= 1e-5


def _probe(path):
    record = json.loads(path.read_text())
    return record["writes"], record["removals"]


def _removed_while_a_write_was_in_flight(writes, removals):
    return [r["path"] for r in removals if any(w["start"] <= r["time"] <= w["end"] for w in writes)]


@pytest.mark.slow  # two 2-rank runs whose nine writes are each slowed by 0.3 s: ~40 s on the loaded box
def test_async_saves_with_top_k_removal_survive_a_kill_during_the_last_ckpt_write(tmp_path, reference):
    """checkpoint_async=True with ModelCheckpoint(save_top_k=1, save_last=True), every write slowed (fit_universal's
    probe): save_top_k asks to remove the previous folder while the next one is still being written; the removal
    waits until that one is written (strategies.checkpoint.defer_removal). Rank 1 is SIGKILLed
    in the middle of the step-4 write of last.ckpt (its data file written, LIGHTNING_SCALE_TEST_SAVE_FAULT), so the
    job fails with that write in flight: last.ckpt (step 2) must stay complete beside the half-written staging
    folder, the rerun (fit(ckpt_path="last")) resumes from it with the uninterrupted run's losses and leaves nothing
    half-written behind, and its own last.ckpt equals its final checkpoint tensor for tensor."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from lightning_scale.checkpoint import dcp_format

    ckpt, out = tmp_path / "ckpt", tmp_path / "async.jsonl"
    cmd = [sys.executable, SCRIPT, "--out", str(out), "--ckpt-dir", str(ckpt), "--format", "universal", "--async",
           "--top-k", "1"]
    env = dict(os.environ, LS_TEST_ASYNC_SLEEP="0.3")
    killed = run_script(cmd, timeout=240, cwd=tmp_path, ranks=2, env=dict(
        env, LS_TEST_ASYNC_PROBE=str(tmp_path / "killed"), LIGHTNING_SCALE_TEST_SAVE_FAULT="after_rank_file@4:1"))
    assert killed.returncode != 0 and not _lines(out), killed.stdout[-2000:] + killed.stderr[-3000:]
    writes, removals = _probe(tmp_path / "killed.0.json")
    assert [r["path"] for r in removals] == ["epoch=0-step=2.ckpt"]
    assert _removed_while_a_write_was_in_flight(writes, removals) == []  # after epoch=1-step=4 was written
    # the 4th save (epochs 0 and 1, last.ckpt twice) died after the rank files: a hidden staging folder, no manifest
    names = sorted(os.listdir(ckpt))
    assert names[1:] == ["epoch=1-step=4.ckpt", "last.ckpt"], names
    assert names[0].startswith(".last.ckpt.") and names[0].endswith(".partial"), names
    assert dcp_format.open_checkpoint(str(ckpt / "last.ckpt"))[1]["step"] == 2  # the write in flight never landed

    rerun = run_script(cmd, timeout=240, cwd=tmp_path, ranks=2,
                       env=dict(env, LS_TEST_ASYNC_PROBE=str(tmp_path / "rerun")))
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-5000:]
    (run,) = _lines(out)
    assert run["start_step"] == 2 and run["global_step"] == 8  # Lightning's "last": last.ckpt, the step-2 one
    assert run["losses"] == {s: reference[s] for s in ("2", "3", "4", "5", "6", "7")}, (run["losses"], reference)
    writes, removals = _probe(tmp_path / "rerun.0.json")
    assert len(removals) == 2 and _removed_while_a_write_was_in_flight(writes, removals) == []
    # the killed job's epoch=1-step=4.ckpt is not the rerun's to remove (Lightning wrote epoch=1-step=4-v1.ckpt)
    assert sorted(os.listdir(ckpt)) == ["epoch=1-step=4.ckpt", "epoch=3-step=8.ckpt", "last.ckpt"]  # no staging
    last, final = tmp_path / "last.pt", tmp_path / "final.pt"
    assert dcp_format.open_checkpoint(str(ckpt / "last.ckpt"))[1]["step"] == 8  # every file's size + checksum
    dcp_to_torch_save(str(ckpt / "last.ckpt"), str(last))
    dcp_to_torch_save(str(ckpt / "epoch=3-step=8.ckpt"), str(final))
    a, b = torch.load(last, weights_only=False), torch.load(final, weights_only=False)
    keys = sorted(k for k, v in a.items() if torch.is_tensor(v))
    assert keys and keys == sorted(k for k, v in b.items() if torch.is_tensor(v))
    assert all(torch.equal(a[k], b[k]) for k in keys) and a["extra/lightning"]["global_step"] == 8


@pytest.mark.slow  # one 2-rank run with slowed writes, ~6-10 s
def test_async_save_top_k_without_save_last_keeps_the_previous_folder_until_the_next_is_written(tmp_path):
    """ModelCheckpoint(save_top_k=1, save_last=False) with checkpoint_async=True: save_top_k asks to remove
    epoch=0-step=2.ckpt right after the step-4 save starts. Rank 1 is killed in the middle of that write: the step-2
    folder must still be there and load (before the fix only two staging folders were left: no checkpoint at all)."""
    from lightning_scale.checkpoint import dcp_format

    ckpt = tmp_path / "ckpt"
    proc = run_script([sys.executable, SCRIPT, "--out", str(tmp_path / "out.jsonl"), "--ckpt-dir", str(ckpt),
                       "--format", "universal", "--async", "--top-k", "1", "--no-last"], timeout=240, cwd=tmp_path,
                      ranks=2, env=dict(os.environ, LS_TEST_ASYNC_PROBE=str(tmp_path / "probe"),
                                        LS_TEST_ASYNC_SLEEP="0.3",
                                        LIGHTNING_SCALE_TEST_SAVE_FAULT="after_rank_file@2:1"))
    assert proc.returncode != 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    visible = [n for n in sorted(os.listdir(ckpt)) if not n.startswith(".")]
    assert visible == ["epoch=0-step=2.ckpt"], sorted(os.listdir(ckpt))
    assert dcp_format.open_checkpoint(str(ckpt / "epoch=0-step=2.ckpt"))[1]["step"] == 2
