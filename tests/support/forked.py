"""Programs a test starts and kills (elastic workers, the store), forked from the harness's fork
server instead of started as new interpreters.

A new interpreter imports torch and hetcomm again: two seconds of a core, more on a busy
machine, for every worker and every restart, which is what made the elastic tests slow and their
timing loose. ``start(module, argv, log)`` runs ``module.main(argv)`` in a process forked from a
server that imported them once; the process is still new (its own memory, no thread of the
server's), its output goes to ``log`` and its environment is the one given. The handle looks like
``subprocess.Popen`` where the tests use it: ``pid``, ``poll()``, ``wait(timeout)``, ``kill()``,
``send_signal()``, ``returncode`` (negative for a signal, as Popen's).
"""
from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys

import harness


def _run_program(module: str, argv: list[str], log_path: str, environ: dict, forked: bool) -> None:
    harness.enter_process(environ, log_path)
    # The fork server runs with SIGINT ignored (multiprocessing's default); a program expects it.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.argv = [module, *argv]
    try:
        code = importlib.import_module(module).main(argv)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        if forked:                      # a spawned interpreter exits as a program does by itself
            harness.exit_like_a_program()
    sys.exit(code or 0)


class Forked:
    """A handle on a forked program, shaped like the parts of ``subprocess.Popen`` tests use."""

    def __init__(self, module: str, argv: list[str], log_path: str, env: dict | None = None) -> None:
        environ = dict(os.environ)
        for k, v in (env or {}).items():   # None unsets a variable
            if v is None:
                environ.pop(k, None)
            else:
                environ[k] = str(v)
        self.args = [module, *argv]
        ctx = harness._context(environ)
        self._proc = ctx.Process(target=_run_program, name=module,
                                 args=(module, list(argv), str(log_path), environ,
                                       ctx.get_start_method() != "spawn"), daemon=True)
        with harness.environment_for(ctx, environ):
            self._proc.start()
        self.pid = self._proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._proc.exitcode

    def send_signal(self, sig: int) -> None:
        if self._proc.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        if self._proc.exitcode is None:
            self._proc.kill()


def start(module: str, argv: list[str], log_path: str, env: dict | None = None) -> Forked:
    """Runs ``module.main(argv)`` in a forked process writing to ``log_path``."""
    return Forked(module, argv, log_path, env)
