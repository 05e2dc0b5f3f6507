"""The shared measuring helpers of the benchmarks (tgattn/bench/measure.py): they measure what they say (no timing asserted)."""
import torch

from tgattn.bench.measure import interleaved


def test_interleaved_runs_every_function_each_round_and_keeps_minima():
    calls, ends = [], []
    wall, cpu, system = interleaved(
        {"a": lambda r: calls.append(("a", r)), "b": lambda r: calls.append(("b", r))}, 3, {"a": 1, "b": 2},
        on_round=ends.append,
    )
    assert calls == [(name, r) for r in range(4) for name in "ab"]  # one warm-up round (0), then three
    assert ends == [0, 1, 2, 3]
    assert set(wall) == set(cpu) == set(system) == {"a", "b"} and all(t >= 0 for t in wall.values())


def test_interleaved_counts_the_page_faults_of_fresh_memory():
    """64 MB is above the allocator's largest reuse threshold: every call maps fresh pages."""
    _, _, system = interleaved({"fresh": lambda r: torch.empty(2**24).fill_(1.0), "none": lambda r: None}, 2)
    assert system["fresh"][1] >= 32 > system["none"][1]  # 16384 small pages, or 32 huge ones
    assert system["fresh"][0] >= 0 and system["none"][0] >= 0


def test_slow_functions_are_timed_once():
    calls = []
    interleaved({"slow": lambda r: calls.append("slow"), "fast": lambda r: calls.append("fast")}, 3,
                slow_s=-1.0)  # every warm-up counts as slow
    assert calls == ["slow", "fast"] * 2  # the warm-up, then round 1 only


def test_setup_runs_outside_the_timing_and_the_call_takes_what_it_made(monkeypatch):
    import types

    from tgattn.bench import measure

    # A clock that moves only when told to: 100 s in each setup, 1 s in each call, so the timing
    # is read from the clock's steps, not from the machine.
    now = [0.0]
    clock = types.SimpleNamespace(perf_counter=lambda: now[0], thread_time=lambda: now[0])
    monkeypatch.setattr(measure, "time", clock)
    made, got = [], []

    def fresh():
        now[0] += 100.0  # not timed
        made.append(len(made))
        return made[-1]

    def call(arg):
        now[0] += 1.0
        got.append(arg)

    wall, cpu, _ = interleaved({"a": call}, 2, setup={"a": fresh})
    assert got == made == [0, 1, 2] and wall["a"] == cpu["a"] == 1.0


def test_sync_brackets_every_call_and_on_call_gets_the_timed_ones():
    events, timed = [], []
    interleaved({"a": lambda r: events.append(("a", r)), "b": lambda r: events.append(("b", r))}, 2,
                alternate=True, sync=lambda: events.append("sync"), on_call=lambda key, s: timed.append(key))
    calls = [e for e in events if e != "sync"]
    assert calls == [("b", 0), ("a", 0), ("a", 1), ("b", 1), ("b", 2), ("a", 2)]  # reversed in even rounds
    assert events == [x for call in calls for x in ("sync", call, "sync")]
    assert timed == ["a", "b", "b", "a"]  # rounds 1 and 2, not the warm-up


def test_a_spent_budget_stops_after_the_first_timed_round():
    from tgattn.bench.measure import best_time

    calls = []
    wall, _, _ = interleaved({"a": calls.append}, 5, budget_s=-1.0)  # spent before the first call
    assert calls == [0, 1] and wall["a"] >= 0.0
    runs = []
    assert best_time(lambda: runs.append(1), False, [], None, repeats=5, budget_s=-1.0) >= 0.0
    assert len(runs) == 2  # the warm-up and one timed run
