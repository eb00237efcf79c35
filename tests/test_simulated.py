"""The simulated cluster's clock (hetcomm.simulated), on fake clocks: a CPU rank's
compute is stretched by the CPU time it got, never by the time it spent waiting for a
core; a GPU rank's by its wall time."""

import pytest

from hetcomm import simulated
from hetcomm.simulated import SimulatedSpeed, Slowdown, fit_to_cores, parse_speeds, speeds_for_this_machine


class FakeClocks:
    """Wall time, this process's CPU time and the sleeps, advanced by hand."""

    def __init__(self, monkeypatch):
        self.wall, self.cpu, self.slept = 0.0, 0.0, []
        monkeypatch.setattr(simulated.time, "perf_counter", lambda: self.wall)
        monkeypatch.setattr(simulated.time, "thread_time", lambda: self.cpu)
        monkeypatch.setattr(simulated.time, "sleep", self.sleep)
        monkeypatch.setattr(simulated.torch, "get_num_threads", lambda: 1)

    def sleep(self, seconds):
        self.slept.append(seconds)
        self.wall += seconds

    def run(self, cpu, waited):
        """A compute phase that got `cpu` seconds of a core and waited `waited` for one."""
        self.cpu += cpu
        self.wall += cpu + waited


def test_cpu_ranks_are_stretched_by_the_cpu_time_they_got(monkeypatch):
    clocks = FakeClocks(monkeypatch)
    speed = SimulatedSpeed(rank=0, speed=0.25)
    with speed.compute(step=0):
        clocks.run(cpu=0.1, waited=0.1)   # another rank held the core half the time
    assert clocks.wall == pytest.approx(0.4)   # 0.1 s of work at a quarter speed, whatever the wait
    with speed.compute(step=1):
        clocks.run(cpu=0.1, waited=0.5)   # waited longer than the stretch: nothing to add
    assert clocks.slept == [pytest.approx(0.2)]


def test_gpu_ranks_are_stretched_by_the_wall_clock(monkeypatch):
    clocks = FakeClocks(monkeypatch)
    speed = SimulatedSpeed(rank=0, speed=0.5, device_type="cuda")
    with speed.compute(step=0):
        clocks.run(cpu=0.01, waited=0.09)   # the host mostly waits for the GPU
    assert clocks.wall == pytest.approx(0.2)


def test_a_slowdown_applies_from_its_step_to_its_rank(monkeypatch):
    clocks = FakeClocks(monkeypatch)
    slowdowns = (Slowdown(rank=1, step=3, factor=0.5),)
    assert [SimulatedSpeed(1, 1.0, slowdowns).factor(step) for step in (2, 3, 9)] == [1.0, 0.5, 0.5]
    assert SimulatedSpeed(0, 1.0, slowdowns).factor(9) == 1.0
    with SimulatedSpeed(1, 1.0, slowdowns).compute(step=3):
        clocks.run(cpu=0.1, waited=0.0)
    assert clocks.wall == pytest.approx(0.2)


def test_settle_brings_the_stretch_up_to_now_and_the_phase_totals_the_same(monkeypatch):
    """A time read within a phase (the handoff's timed forward) is at the simulated
    speed, and the phase as a whole still takes its compute over the speed."""
    clocks = FakeClocks(monkeypatch)
    with SimulatedSpeed(rank=0, speed=0.25).compute(step=0) as settle:
        clocks.run(cpu=0.1, waited=0.0)
        settle()
        assert clocks.wall == pytest.approx(0.4)
        clocks.run(cpu=0.2, waited=0.0)
    assert clocks.wall == pytest.approx(1.2)
    assert clocks.slept == [pytest.approx(0.3), pytest.approx(0.6)]
    # A wait for a core in the first part, longer than that part's stretch, still counts
    # against the whole phase's: 0.2 s of CPU at half speed is 0.4 s, already passed by 0.5.
    clocks.slept.clear()
    with SimulatedSpeed(rank=0, speed=0.5).compute(step=0) as settle:
        clocks.run(cpu=0.1, waited=0.3)
        settle()
        clocks.run(cpu=0.1, waited=0.0)
    assert clocks.slept == []


def test_fit_to_cores_scales_down_never_up():
    fitted = fit_to_cores([1.0, 1.0, 0.5, 0.25], cores=2)
    assert sum(fitted) == pytest.approx(0.75 * 2)
    assert fitted[0] / fitted[3] == pytest.approx(4.0)   # the ratios stay
    assert fit_to_cores([0.5, 0.25], cores=16) == [0.5, 0.25]


def test_speeds_for_this_machine_is_what_parse_speeds_reads_back(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    text = speeds_for_this_machine([1.0, 1.0, 0.5, 0.25])
    assert parse_speeds(text, 4) == pytest.approx(fit_to_cores([1.0, 1.0, 0.5, 0.25], cores=2), rel=1e-3)
