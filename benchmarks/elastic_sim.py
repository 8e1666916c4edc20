"""Fault-tolerant DiLoCo on the simulated cluster (needs root): kill a worker, restart it; random kills.

    python benchmarks/elastic_sim.py --repeats 3 --json benchmarks/results/elastic_sim.json
    python benchmarks/elastic_sim.py --random-kills 20 --json benchmarks/results/elastic_random_kills.json

Every worker is ``examples/train_elastic.py`` (the small character GPT) in a rank's namespace and
CPU cgroup of ``hetcomm.sim`` (quotas 0.8,0.4,0.2,0.2, NICs 100 Mbit/s by default), started on its
own; the store (``python -m hetcomm.store``) runs in the hub, outside every worker. Batches are
proportional to the quotas (32,16,8,8 by default), so a round of ``--steps`` steps takes about as
long on every worker. Default heartbeat 2 s and timeout 10 s (as INTELLECT-1).

**Kill and restart** (per repeat, the three runs interleaved, same sample budget):
``four`` (uninterrupted), ``three`` (ranks 0-2 only), ``kill`` (four workers; the last is killed
with SIGKILL ``--half-round`` seconds into round ``--kill-round`` and started again ``--restart-after`` seconds
later in the same namespace and cgroup). Reported: the survivors' samples/s over the rounds
without the victim (with and without the round in which its death was detected, which waits up
to the timeout) against the ``three`` run's samples/s; how many rounds were committed between
the restart and the first round the restarted worker contributed to (from the process start and
from its join request, after Python and torch imported); final held-out loss against ``four``,
and (``--eval-windows``) the held-out loss of the global parameters after every round (saved by
the first worker, which is never killed, evaluated here after the run) as a curve over the
samples, so that ``kill`` is compared with ``four`` at equal samples (linear between rounds).
Round records land late with overlap and hold the policies' measurement rounds, so the survivors'
figure is also taken directly, from the workers' progress lines (samples trained, about once a
second): the survivors' samples from the kill to the moment a survivor saw the victim admitted
again, against the samples of the ``three`` run over the same seconds from its start.

**Random kills** (``--random-kills N``): one long run; every ``--kill-every`` rounds a random live
worker is killed at a random moment of the round and restarted 2-8 s later. Reported: hangs (a
process still running past the deadline), rounds whose fingerprints of the global parameters
differ between any two reports (every incarnation of every worker reports every round it
committed), and the membership changes.

``--json`` writes the summary, one record per line (hetcomm.bench.records), each with the command:
a ``run`` header (the options; kill and restart: ``summary``, ``per_repeat``, ``hangs``,
``split_rounds``; random kills: the run's figures), then one ``result`` per run (``name``,
``repeat``, its figures). The trace, ``traces/NAME.jsonl.gz`` beside it
(hetcomm.bench.records.write_with_trace), holds per run (``name``, ``repeat``) a ``round`` per
committed round (``t``, ``members``, ``samples``), a ``membership`` per membership event, a
``loss`` per point of the loss curve (``samples``, ``loss``) and a ``progress`` per progress line
(``rank``, ``t``, ``samples``); random kills: a ``kill`` per kill.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from hetcomm.bench.records import RESULT, RUN, command_line, record, write_with_trace
from hetcomm.sim import SimCluster, SimSpec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "train_elastic.py")


class Job:
    """Workers of one elastic run on the cluster, each a process started (and killed) on its own."""

    def __init__(self, cluster: SimCluster, args: argparse.Namespace, name: str, out: str, ranks,
                 seed: int | None = None) -> None:
        self.cluster, self.args, self.name, self.out, self.ranks = cluster, args, name, out, list(ranks)
        self.seed = args.seed if seed is None else seed
        self.procs: dict[int, subprocess.Popen] = {}
        self.starts: list[dict] = []
        self.kills: list[dict] = []
        with cluster.netns("hub"):
            self.store = subprocess.Popen([sys.executable, "-m", "hetcomm.store", "--port", "0"],
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(x) for x in self.store.stdout], daemon=True).start()
        seen, port, deadline = "", None, time.time() + 60
        while port is None and time.time() < deadline:
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                continue
            seen += line
            found = re.search(r"serving a TCPStore on [^ ]*:(\d+)", line)
            port = int(found.group(1)) if found else None
        if port is None:
            self.store.kill()
            raise SystemExit(f"elastic_sim: the store did not start: {seen}")
        self.address = f"{cluster.hub_address}:{port}"

    def batch(self, rank: int) -> int:
        return int(self.args.batches.split(",")[rank])

    def start(self, rank: int) -> None:
        a = self.args
        argv = [sys.executable, EXAMPLE, "--store", self.address, "--id", f"w{rank}", "--job", self.name,
                "--min-workers", str(len(self.ranks)), "--steps", str(a.steps), "--batch", str(self.batch(rank)),
                "--samples", str(a.samples), "--rounds", str(a.rounds), "--seed", str(self.seed),
                "--heartbeat", str(a.heartbeat), "--timeout", str(a.timeout),
                "--jsonl", os.path.join(self.out, f"w{rank}.jsonl"), "--progress-seconds", "1",
                *a.example_args.split()]
        if rank == 0 and a.eval_windows:
            os.makedirs(os.path.join(self.out, "globals"), exist_ok=True)
            argv += ["--save-globals", os.path.join(self.out, "globals")]
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **self.cluster.rank_env(rank))
        log = open(os.path.join(self.out, f"w{rank}.log"), "a")
        self.procs[rank] = subprocess.Popen(self.cluster.command_for(rank, argv), env=env, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
        self.starts.append({"rank": rank, "t": time.time()})

    def kill(self, rank: int) -> None:
        os.killpg(self.procs[rank].pid, signal.SIGKILL)
        self.procs[rank].wait()
        self.kills.append({"rank": rank, "t": time.time()})

    def records(self, rank: int) -> list[dict]:
        path = os.path.join(self.out, f"w{rank}.jsonl")
        if not os.path.exists(path):
            return []
        out = []
        for line in open(path):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:       # (a line being written as it is read)
                pass
        return out

    def rounds_seen(self) -> int:
        return max((r.get("round", 0) for k in self.ranks for r in self.records(k)), default=0)

    def wait(self, deadline: float) -> list[int]:
        """Waits for every worker; the ranks still running at the deadline (killed then) are hangs."""
        hung = []
        for rank, proc in self.procs.items():
            try:
                proc.wait(timeout=max(1.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                hung.append(rank)
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.store.kill()
        self.store.wait()
        return hung

    def agreement(self) -> tuple[dict[int, int], list[int]]:
        """round -> fingerprint, and the rounds whose reports disagree."""
        prints: dict[int, set] = {}
        for k in self.ranks:
            for r in self.records(k):
                if "round" in r:
                    prints.setdefault(r["round"], set()).add(r["fp"])
        return {r: next(iter(f)) for r, f in prints.items()}, sorted(r for r, f in prints.items() if len(f) > 1)

    def finals(self) -> dict[int, dict]:
        return {k: [r for r in self.records(k) if "final" in r][-1] for k in self.ranks
                if any("final" in r for r in self.records(k))}


def rounds_of(job: Job) -> list[dict]:
    """One record per committed round (the first report of it), in order."""
    seen: dict[int, dict] = {}
    for k in job.ranks:
        for r in job.records(k):
            if "round" in r and (r["round"] not in seen or r["t"] < seen[r["round"]]["t"]):
                seen[r["round"]] = r
    return [seen[r] for r in sorted(seen)]


def rate(rounds: list[dict], first: int, last: int) -> float | None:
    """Samples/s over rounds first..last (round numbers), timed from the commit of round first-1."""
    by = {r["round"]: r for r in rounds}
    if first - 1 not in by or last not in by or last < first:
        return None
    samples = sum(sum(by[i]["samples"]) for i in range(first, last + 1))
    return samples / (by[last]["t"] - by[first - 1]["t"])


def progress_of(job: Job, started: float) -> list[list]:
    """[rank, seconds from ``started``, samples it trained so far], from the example's progress
    lines (about one a second, and one at each membership change it saw), in time order."""
    return sorted([k, r["t"] - started, r["progress"]] for k in job.ranks for r in job.records(k) if "progress" in r)


def samples_between(progress: list[list], ranks, t0: float, t1: float) -> int:
    """Samples ``ranks`` trained between ``t0`` and ``t1`` (seconds from the run's start): each
    rank's last progress line at or before each end (one incarnation per rank: survivors)."""
    def at(k: int, t: float) -> int:
        return max((n for r, u, n in progress if r == k and u <= t), default=0)
    return sum(at(k, t1) - at(k, t0) for k in ranks)


def back_time(job: Job, victim: int, restart_abs: float, started: float) -> float | None:
    """When the first survivor saw the restarted victim admitted (seconds from ``started``)."""
    return min((r["t"] - started for k in job.ranks if k != victim for r in job.records(k)
                if "event" in r and r["t"] >= restart_abs and f"w{victim}" in r["event"].get("joined", [])),
               default=None)


_CHANGE = re.compile(r"\[w(\d+)\]: generation (\d+) started ([\d.]+) s after the (.+?) \(")


def generation_changes(out_dir: str, ranks) -> list[dict]:
    """What each change of generation cost each worker (`hetcomm.train.elastic.phases`: the line
    every worker logs in ``out_dir`` when a generation starts): rank, generation, seconds and
    what began it (``failure``, ``agreement to change members``, ``decision that admits it``)."""
    out = []
    for k in ranks:
        path = os.path.join(out_dir, f"w{k}.log")
        for line in open(path, errors="replace") if os.path.exists(path) else []:
            found = _CHANGE.search(line)
            if found:
                out.append({"rank": int(found.group(1)), "generation": int(found.group(2)),
                            "seconds": float(found.group(3)), "after": found.group(4)})
    return out


def survivors_stop(kill: dict, after: str) -> float | None:
    """The longest of the survivors' stops at the victim's failure or readmission (seconds)."""
    victim = kill["ranks"][-1]
    stops = [c["seconds"] for c in kill.get("generation_changes") or [] if c["rank"] != victim
             and c["after"] == after and c["generation"] > 1]
    return max(stops) if stops else None


def victim_figures(table: list[dict], vid: str, restart_t: float, asked_t: float | None,
                   first_contribution: int | None) -> dict:
    """From the round table (times from the run's start, a round's time when its record was
    written: with overlap up to a round after its steps) and the first round the restarted
    incarnation contributed steps to (from its own records): the rounds without the victim,
    how many rounds that contribution came after the restart (and after its join request), and
    the survivors' samples/s while it was gone (over the rounds without it; when it rejoined
    inside the round it died in, over that round, its own samples left out)."""
    by = {r["round"]: r for r in table}
    gone = [r["round"] for r in table if vid not in r["members"]]
    b = first_contribution
    out = {"gone_rounds": gone, "contributes_in_round": b, "rounds_from_restart_to_contribution": None,
           "rounds_from_join_request_to_contribution": None, "survivors_samples_per_s": None,
           "survivors_samples_per_s_after_detection": None}

    def survivors(first: int, last: int) -> float | None:
        if first - 1 not in by or last not in by or last < first or by[last]["t"] <= by[first - 1]["t"]:
            return None
        n = sum(s for i in range(first, last + 1) for m, s in zip(by[i]["members"], by[i]["samples"]) if m != vid)
        return n / (by[last]["t"] - by[first - 1]["t"])
    if gone:
        out["survivors_samples_per_s"] = survivors(gone[0], gone[-1])
        out["survivors_samples_per_s_after_detection"] = survivors(gone[0] + 1, gone[-1]) if len(gone) > 1 else None
    elif b is not None:
        out["survivors_samples_per_s"] = survivors(b, b)
    if b is not None:
        out["rounds_from_restart_to_contribution"] = b - max((r["round"] for r in table if r["t"] <= restart_t),
                                                             default=0)
        if asked_t is not None:
            out["rounds_from_join_request_to_contribution"] = b - max(
                (r["round"] for r in table if r["t"] <= asked_t), default=0)
    return out


def first_contribution(lines: list[dict], vid: str, restart_abs: float) -> int | None:
    """The first round the incarnation started at ``restart_abs`` (or later) reports with steps of
    its own (the example's records: a ``start`` line, then one per round it applied)."""
    pid = next((r["pid"] for r in lines if "start" in r and r["start"] >= restart_abs - 1), None)
    return next((r["round"] for r in lines if r.get("pid") == pid and "round" in r and vid in r["members"]
                 and r["steps"][r["members"].index(vid)] > 0), None) if pid is not None else None


def loss_curve(job: Job, rounds: list[dict], windows: int) -> list[tuple[int, float]]:
    """(samples so far, held-out loss of the global parameters) after every round the first
    worker saved (the example's model, corpus and seed)."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import torch
    from char_gpt import build, evaluate
    _, held_out, model = build(1_000_000, job.seed, 16, 256, 3, 4)
    params = [p for p in model.parameters() if p.is_floating_point()]
    curve, total = [(0, evaluate(model, held_out, min(len(held_out), windows)))], 0
    for r in rounds:
        total += sum(r["samples"])
        path = os.path.join(job.out, "globals", f"round{r['round']}.pt")
        if not os.path.exists(path):
            continue
        with torch.no_grad():
            for p, g in zip(params, torch.load(path)):
                p.copy_(g)
        curve.append((total, evaluate(model, held_out, min(len(held_out), windows))))
    return curve


def at_samples(curve: list[tuple[int, float]], samples: int) -> float | None:
    """The curve's loss at ``samples`` (linear between its points; None outside them)."""
    for (s0, l0), (s1, l1) in zip(curve, curve[1:]):
        if s0 <= samples <= s1:
            return l0 + (l1 - l0) * (samples - s0) / (s1 - s0) if s1 > s0 else l1
    return None


def run_job(cluster, args, name, ranks, victim=None, seed=None) -> dict:
    out = tempfile.mkdtemp(prefix=f"elastic-{name}-")
    job = Job(cluster, args, f"{name}-{os.getpid()}-{time.time_ns()}", out, ranks, seed)
    started = time.time()
    for k in ranks:
        job.start(k)
    restart = None
    if victim is not None:
        while job.rounds_seen() < args.kill_round - 1:
            if any(p.poll() is not None for p in job.procs.values()):
                break
            time.sleep(0.05)
        time.sleep(args.half_round)
        job.kill(victim)
        time.sleep(args.restart_after)
        job.start(victim)
        restart = time.time()
    hung = job.wait(time.time() + args.deadline)
    rounds = rounds_of(job)
    prints, split = job.agreement()
    finals = job.finals()
    losses = [f["loss"] for f in finals.values() if f.get("loss") is not None]
    result = {"name": name, "ranks": ranks, "hung": hung, "rounds": len(rounds), "split_rounds": split,
              "samples": sum(sum(r["samples"]) for r in rounds), "wall_s": time.time() - started,
              "final_loss": statistics.median(losses) if losses else None,
              "final_fingerprints_agree": len({f["final"] for f in finals.values() if f.get("loss") is not None}) <= 1,
              "membership": next(iter(finals.values()))["stats"]["membership"] if finals else [],
              "round_table": [{"round": r["round"], "t": r["t"] - started, "members": r["members"],
                               "samples": r["samples"]} for r in rounds],
              "out_dir": out}
    result["progress"] = progress_of(job, started)
    result["generation_changes"] = generation_changes(job.out, job.ranks)
    last = rounds[-1]["round"] if rounds else 0
    result["samples_per_s"] = rate(rounds, 2, last)
    if args.eval_windows:
        result["loss_curve"] = loss_curve(job, rounds, args.eval_windows)
    if victim is not None:
        lines = job.records(victim)
        asked = [r for r in lines if "start" in r and r["start"] >= restart - 1]
        result.update({"kill_t": job.kills[0]["t"] - started, "restart_t": restart - started,
                       "back_t": back_time(job, victim, restart, started),
                       "asked_t": asked[0]["start"] - started if asked else None})
        result.update(victim_figures(result["round_table"], f"w{victim}", result["restart_t"], result["asked_t"],
                                     first_contribution(lines, f"w{victim}", restart)))
    print(f"  {name}: {result['rounds']} rounds, {result['samples']} samples, "
          f"{result['samples_per_s'] or 0:.1f} samples/s, loss {result['final_loss']}, hung {hung}, split {split}"
          + (f", survivors {result['survivors_samples_per_s'] or 0:.1f} samples/s "
             f"({result['survivors_samples_per_s_after_detection'] or 0:.1f} after detection), restarted worker "
             f"contributes {result['rounds_from_restart_to_contribution']} rounds after its restart "
             f"({result['rounds_from_join_request_to_contribution']} after asking to join)"
             if victim is not None else ""), flush=True)
    return result


def random_kills(cluster, args) -> dict:
    out = tempfile.mkdtemp(prefix="elastic-random-")
    ranks = list(range(cluster.world_size))
    job = Job(cluster, args, f"random-{os.getpid()}-{time.time_ns()}", out, ranks)
    rng = random.Random(args.seed)
    started = time.time()
    for k in ranks:
        job.start(k)
    pending: list[tuple[float, int]] = []          # (when, rank) restarts
    next_kill_round = args.kill_round

    def restarts() -> None:
        now = time.time()
        for item in [p for p in pending if p[0] <= now]:
            pending.remove(item)
            job.start(item[1])

    while len(job.kills) < args.random_kills and time.time() - started < args.deadline:
        restarts()
        if job.rounds_seen() >= next_kill_round:
            time.sleep(rng.uniform(0, 2 * args.half_round))
            live = [k for k in ranks if job.procs[k].poll() is None and all(k != p[1] for p in pending)]
            if len(live) > 1:
                victim = rng.choice(live)
                job.kill(victim)
                pending.append((time.time() + rng.uniform(2, 8), victim))
                print(f"  kill {len(job.kills)}/{args.random_kills}: w{victim} at round {job.rounds_seen()}",
                      flush=True)
            next_kill_round = job.rounds_seen() + args.kill_every
        time.sleep(0.05)
    while pending:
        restarts()
        time.sleep(0.05)
    hung = job.wait(time.time() + args.deadline)
    prints, split = job.agreement()
    finals = job.finals()
    result = {"kills": len(job.kills), "hung": hung, "rounds": len(prints), "split_rounds": split,
              "final_fingerprints": sorted({f["final"] for f in finals.values() if f.get("loss") is not None}),
              "membership_changes": len(next(iter(finals.values()))["stats"]["membership"]) if finals else None,
              "wall_s": time.time() - started, "kill_log": job.kills, "out_dir": out}
    print(f"random kills: {result['kills']} kills, {result['rounds']} rounds, hangs {hung}, rounds whose "
          f"fingerprints differ {split}, final fingerprints {result['final_fingerprints']}", flush=True)
    return result


# per round, per event, per curve point, per progress line, per kill
TRACE_KINDS = ("round", "membership", "loss", "progress", "kill")
RUN_KEY = ("name", "repeat")                             # what ties a trace record to its run's result
_TRACED = ("round_table", "membership", "loss_curve", "progress")   # a run's series, one trace record each


def elastic_records(doc: dict) -> list[dict]:
    """The records of main()'s document: the header, then per run its ``result`` and its trace
    records (the random-kills run's kills follow the header)."""
    out = [record(RUN, {k: v for k, v in doc.items() if k not in ("runs", "kill_log")})]
    out += [record("kill", kill) for kill in doc.get("kill_log", ())]
    for name, runs in doc.get("runs", {}).items():
        for repeat, run in enumerate(runs):
            which = {"name": name, "repeat": repeat}
            figures = {k: v for k, v in run.items() if k not in (*_TRACED, "name")}
            out.append(record(RESULT, which, **figures))
            out += [record("round", which, **r) for r in run["round_table"]]
            out += [record("membership", which, **event) for event in run["membership"]]
            out += [record("loss", which, samples=samples, loss=loss)
                    for samples, loss in run.get("loss_curve", ())]
            out += [record("progress", which, rank=k, t=t, samples=n) for k, t, n in run.get("progress", ())]
    return out


def summarise(runs: dict) -> tuple[list[dict], dict]:
    """Per repeat, the kill run against the same repeat's three- and four-worker runs; then the
    median and range of each figure over the repeats."""
    ratios = []
    for three, kill, four in zip(runs["three"], runs["kill"], runs["four"]):
        # From the kill to the victim's admission, by the progress lines: the survivors' samples
        # against those of the three-worker run over the same seconds from its start.
        gone = (kill.get("kill_t"), kill.get("back_t"))
        while_gone = None
        if None not in gone and gone[1] > gone[0] and kill.get("progress") and three.get("progress"):
            theirs = samples_between(three["progress"], three["ranks"], *gone)
            ours = samples_between(kill["progress"], [k for k in kill["ranks"] if k != kill["ranks"][-1]], *gone)
            while_gone = ours / theirs if theirs else None
        ratios.append({
            "survivors_while_gone_vs_three_same_seconds": while_gone,
            "seconds_gone": gone[1] - gone[0] if None not in gone else None,
            "survivors_vs_three": (kill["survivors_samples_per_s"] / three["samples_per_s"]
                                   if kill["survivors_samples_per_s"] and three["samples_per_s"] else None),
            "survivors_after_detection_vs_three": (
                kill["survivors_samples_per_s_after_detection"] / three["samples_per_s"]
                if kill["survivors_samples_per_s_after_detection"] and three["samples_per_s"] else None),
            "loss_kill_vs_four": (kill["final_loss"] / four["final_loss"]
                                  if kill["final_loss"] and four["final_loss"] else None),
            "samples_kill_vs_four": kill["samples"] / four["samples"] if four["samples"] else None,
            # both curves at the uninterrupted run's samples (the kill run ends past them)
            "loss_kill_vs_four_equal_samples": (
                at_samples(kill["loss_curve"], four["samples"]) / four["loss_curve"][-1][1]
                if kill.get("loss_curve") and four.get("loss_curve")
                and at_samples(kill["loss_curve"], four["samples"]) else None),
            "rounds_from_restart_to_contribution": kill["rounds_from_restart_to_contribution"],
            "rounds_from_join_request_to_contribution": kill["rounds_from_join_request_to_contribution"],
            # the survivors' stop (the longest of theirs) from the failure, and from the agreement
            # to readmit the victim, to the next generation's first step (their logs)
            "survivors_stop_at_failure_s": survivors_stop(kill, "failure"),
            "survivors_stop_at_readmission_s": survivors_stop(kill, "agreement to change members"),
        })

    def med(key):
        vals = [r[key] for r in ratios if r[key] is not None]
        return {"median": statistics.median(vals), "min": min(vals), "max": max(vals)} if vals else None
    summary = {k: med(k) for k in ratios[0]}
    return ratios, summary


def rescore(path: str) -> int:
    """Recomputes a kill benchmark's victim figures and summary from its records (``--rescore``):
    its runs' round tables, kill, restart and join-request times are kept; the command that
    measured them stays in the header (``measured_by``)."""
    from hetcomm.bench.records import read_with_trace
    recs = read_with_trace(path)
    head = next(r for r in recs if r["kind"] == RUN)
    victim = f"w{len(str(head['cpu_quota']).split(',')) - 1}"
    runs: dict[str, list[dict]] = {}
    index: dict[tuple, dict] = {}
    for r in recs:
        body = {k: v for k, v in r.items() if k not in ("kind", "command")}
        if r["kind"] == RESULT:
            run = {**body, "round_table": [], "membership": [], "loss_curve": [], "progress": []}
            runs.setdefault(body["name"], []).append(run)
            index[(body["name"], body["repeat"])] = run
        elif r["kind"] in ("round", "membership", "loss", "progress"):
            run = index[(body.pop("name"), body.pop("repeat"))]
            if r["kind"] == "round":
                run["round_table"].append(body)
            elif r["kind"] == "membership":
                run["membership"].append(body)
            elif r["kind"] == "progress":
                run["progress"].append([body["rank"], body["t"], body["samples"]])
            else:
                run["loss_curve"].append((body["samples"], body["loss"]))
    for run in runs.get("kill", []):
        if "generation_changes" not in run and os.path.isdir(run["out_dir"]):     # (measured before they were kept)
            run["generation_changes"] = generation_changes(run["out_dir"], run["ranks"])
        # the victim's records (absolute times) against the run's (from its start)
        lines = [json.loads(x) for x in open(os.path.join(run["out_dir"], f"{victim}.jsonl")) if x.strip()]
        by = {r["round"]: r["t"] for r in run["round_table"]}
        mine = [r for r in lines if "round" in r and r["round"] in by and "t" in r]
        if not mine:
            continue                                           # (the victim reported no round: nothing to place)
        offset = min(r["t"] - by[r["round"]] for r in mine)    # (the table's time is the earliest report)
        if "asked_t" not in run:
            run["asked_t"] = next((r["start"] - offset for r in lines
                                   if "start" in r and r["start"] - offset >= run["restart_t"] - 1), None)
        run.update(victim_figures(run["round_table"], victim, run["restart_t"], run["asked_t"],
                                  first_contribution(lines, victim, run["restart_t"] + offset)))
    ratios, summary = summarise(runs)
    header = {k: v for k, v in head.items() if k not in ("kind", "command", "trace", "summary", "per_repeat")}
    doc = {**header, "measured_by": head.get("measured_by", head.get("command")), "summary": summary,
           "per_repeat": ratios, "runs": runs}
    print(json.dumps(summary, indent=1))
    write_with_trace(path, elastic_records(doc), command_line(), TRACE_KINDS, RUN_KEY)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu-quota", default="0.8,0.4,0.2,0.2")
    ap.add_argument("--nic-mbit", default="100")
    ap.add_argument("--batches", default="32,16,8,8", help="per-rank batch (∝ quota: rounds of equal length)")
    ap.add_argument("--steps", type=int, default=24, help="inner steps per round (about 4.5-5 s rounds on a 2-core machine)")
    ap.add_argument("--samples", type=int, default=15360, help="sample budget of each run (0: --rounds): 10 rounds of four")
    ap.add_argument("--rounds", type=int, default=0)
    ap.add_argument("--heartbeat", type=float, default=2.0)
    ap.add_argument("--timeout", type=float, default=10.0)
    ap.add_argument("--kill-round", type=int, default=3)
    ap.add_argument("--half-round", type=float, default=4.5, help="seconds into the round at which to kill")
    ap.add_argument("--restart-after", type=float, default=5.0)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--random-kills", type=int, default=0, help="instead: one long run with this many kills")
    ap.add_argument("--kill-every", type=int, default=4, help="random kills: rounds between kills")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--deadline", type=float, default=900.0, help="seconds after which a worker counts as hung")
    ap.add_argument("--example-args", default="", help="more flags for examples/train_elastic.py")
    ap.add_argument("--eval-windows", type=int, default=512,
                    help="held-out windows for the per-round loss curve (0: none; the example's final loss uses 256)")
    ap.add_argument("--json", default="")
    ap.add_argument("--rescore", metavar="JSON", help="recompute the victim figures and summary of a kill benchmark's "
                    "results (its round tables and times), rewriting the file")
    args = ap.parse_args(argv)
    if args.rescore:
        return rescore(args.rescore)
    quotas = [float(q) for q in args.cpu_quota.split(",")]
    spec = SimSpec(cpu_quota=quotas, nic_mbit=[float(args.nic_mbit)] * len(quotas) if args.nic_mbit else None)
    with SimCluster(spec) as cluster:
        if args.random_kills:
            doc = {"scenario": "random kills", **vars(args), **random_kills(cluster, args)}
            ok = not doc["hung"] and not doc["split_rounds"] and len(doc["final_fingerprints"]) == 1
        else:
            runs = {"four": [], "three": [], "kill": []}
            for i in range(args.repeats):
                print(f"repeat {i + 1}/{args.repeats}", flush=True)
                seed = args.seed + i         # the runs of a repeat share it: paired data and model
                runs["four"].append(run_job(cluster, args, "four", list(range(len(quotas))), seed=seed))
                runs["three"].append(run_job(cluster, args, "three", list(range(len(quotas) - 1)), seed=seed))
                runs["kill"].append(run_job(cluster, args, "kill", list(range(len(quotas))), victim=len(quotas) - 1,
                                            seed=seed))
            ratios, summary = summarise(runs)
            hung = [r["hung"] for rs in runs.values() for r in rs if r["hung"]]
            split = [r["split_rounds"] for rs in runs.values() for r in rs if r["split_rounds"]]
            doc = {"scenario": "kill and restart", **vars(args), "summary": summary, "per_repeat": ratios,
                   "hangs": hung, "split_rounds": split, "runs": runs}
            print(json.dumps(summary, indent=1))
            ok = not hung and not split
    if args.json:
        write_with_trace(args.json, elastic_records(doc), command_line(), TRACE_KINDS, RUN_KEY)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
