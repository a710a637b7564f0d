"""What a sandbox run returns: its limits, one outcome per test, and the run's status."""

from __future__ import annotations

from dataclasses import dataclass, field

from mrl.core.config import UserError

STATUSES = ("ok", "timeout", "memory", "crashed", "syntax_error")


class SandboxUnavailable(UserError):
    """The sandbox asked for cannot run here (bwrap missing, or namespaces refused by the kernel or container)."""


@dataclass(frozen=True)
class SandboxLimits:
    cpu_seconds: float = 2.0  # RLIMIT_CPU (rounded up to whole seconds, at least 1)
    wall_seconds: float = 5.0  # the whole process group is killed after this
    memory_mb: int = 256  # RLIMIT_AS (address space)
    max_output_bytes: int = 65536  # stdout/stderr are each captured up to this; the rest is drained and dropped
    max_value_bytes: int = 1 << 20  # a probe's value (as JSON) or an I/O test's stdout larger than this fails the test


@dataclass(frozen=True)
class TestOutcome:
    __test__ = False  # not a pytest test class

    passed: bool
    error: str | None  # exception class name, or "timeout" / "memory" / "crashed" / "syntax_error" for lost tests


@dataclass(frozen=True)
class SandboxResult:
    outcomes: list[TestOutcome]  # one per test, in order
    status: str  # "ok" | "timeout" | "memory" | "crashed" | "syntax_error"
    stdout: str = field(default="", repr=False)  # what the code printed, truncated to max_output_bytes
    stderr: str = field(default="", repr=False)
    returncode: int | None = None  # of the child (negative: killed by that signal)

    @property
    def pass_rate(self) -> float:
        return sum(o.passed for o in self.outcomes) / len(self.outcomes) if self.outcomes else 0.0

    @property
    def error_rate(self) -> float:
        """Share of tests that raised (any error, including timeout/memory/crash), for a "bug ratio" channel."""
        return sum(o.error is not None for o in self.outcomes) / len(self.outcomes) if self.outcomes else 0.0
