"""The hand-off of DiLoCo's state between the training thread and the background thread when the
state lives on a GPU (`state_device`).

A CUDA kernel runs when its stream gets to it, not when Python queues it: a background job that
reads a pseudo-gradient the training thread computed must wait for the training thread's
stream, and a job's future must not say "done" before the job's own kernels (the outer step,
the decoded update) have run, since the training thread then reads them on its stream, which
may be another than the background thread's (a training loop under ``torch.cuda.stream(s)``).
On the CPU both are no-ops.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch


def fence(device: torch.device) -> "torch.cuda.Event | None":
    """On the training thread, once it has written what a background job will read: an event on
    its current stream of ``device`` (None on the CPU)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def settle(device: torch.device) -> None:
    """On the background thread, before it tells the training thread that a part of its job has
    landed (`DiLoCo._landed`, read without waiting for the job): that part's kernels have run."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def after(event: "torch.cuda.Event | None", device: torch.device, job: Callable) -> Callable:
    """``job`` for the background thread: its stream waits for ``event`` (on the GPU, not the
    thread), and the job returns once its kernels have run."""
    if event is None:
        return job

    @functools.wraps(job)
    def run(*args, **kwargs):
        stream = torch.cuda.current_stream(device)
        stream.wait_event(event)
        try:
            return job(*args, **kwargs)
        finally:
            stream.synchronize()
    return run
