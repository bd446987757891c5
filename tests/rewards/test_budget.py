"""Rate budgets shared by every reward worker of a run: how the owner divides them among the live
workers (a join, a death, a leave, a hot-plugged worker), the share before a lease and after it
runs out, the budget's id, and the lease as it crosses the wire."""

import asyncio

import pytest
from pydantic import ValidationError

from asyncrl.config import RunConfig
from asyncrl.rewards.budget import LeaseTable, RateBudgets, Slots, budget_id, split
from asyncrl.rewards.judge import JsonScorerConfig
from asyncrl.wire.codec import decode, encode
from asyncrl.wire.messages import RateLease, RateShare
from asyncrl.wire.schema import WireError

URL = "https://judge.example.com/v1/score"


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def owner_table(timeout_s: float = 2.0, **limits) -> tuple[LeaseTable, RateBudgets, Clock, str]:
    budgets, clock = RateBudgets(), Clock()
    cfg = JsonScorerConfig(url=URL, api_key_env="JUDGE_KEY", **({"concurrency": 8, "rpm": 600.0} | limits))
    budgets.limiter(cfg)
    return LeaseTable(budgets, timeout_s, clock), budgets, clock, budget_id(URL, "JUDGE_KEY")


def shares(leases: dict[bytes, RateLease]) -> dict[bytes, tuple[int, float]]:
    return {peer: (lease.shares[0].concurrency, lease.shares[0].rpm) for peer, lease in leases.items()}


def test_split_divides_each_limit_and_the_shares_add_up_to_the_budget():
    budget = RateShare(budget="b", concurrency=5, rpm=600.0, tpm=90_000.0)
    parts = [split(budget, 3, i) for i in range(3)]
    assert [p.concurrency for p in parts] == [2, 2, 1]
    assert [p.rpm for p in parts] == [200.0] * 3 and sum(p.tpm for p in parts) == pytest.approx(90_000)
    assert split(RateShare(budget="b", concurrency=2), 4, 3).concurrency == 1  # at least one each
    with pytest.raises(ValueError, match=r"index \(3\) must be in \[0, n\)"):
        split(budget, 3, 3)


def test_a_join_a_death_and_a_hot_plug_divide_the_budget_again():
    table, budgets, clock, bid = owner_table()
    own = budgets.limiters[bid]
    assert table.update() == {} and (own.share.concurrency, own.share.rpm) == (8, 600.0)  # alone: the whole

    table.heard(b"a", "reward-a", [bid], leaving=False)  # a worker joins
    assert shares(table.update()) == {b"a": (4, 300.0)}
    assert (own.share.concurrency, own.share.rpm) == (4, 300.0)

    clock.now += 0.1
    table.heard(b"a", "reward-a", [bid], leaving=False)
    table.heard(b"b", "reward-b", [bid], leaving=False)  # hot-plugged: both get a new lease
    assert shares(table.update()) == {b"a": (3, 200.0), b"b": (2, 200.0)}
    assert own.share.rpm == 200.0 and own.share.concurrency == 3

    clock.now += 1.0  # a is still heard, b goes silent: still alive, both leases renewed as they were
    table.heard(b"a", "reward-a", [bid], leaving=False)
    assert shares(table.update()) == {b"a": (3, 200.0), b"b": (2, 200.0)}
    clock.now += 1.5  # b unheard for 2.5 s > 2 s: dead, its share goes back
    table.heard(b"a", "reward-a", [bid], leaving=False)
    assert shares(table.update()) == {b"a": (4, 300.0)} and own.share.rpm == 300.0
    assert table.workers(bid) == 2

    table.heard(b"a", "reward-a", [bid], leaving=True)  # a leaves: the owner has it all again
    assert table.update() == {} and (own.share.concurrency, own.share.rpm) == (8, 600.0)


def test_a_lease_is_renewed_before_it_runs_out_and_resent_when_it_could_not_go():
    table, _budgets, clock, bid = owner_table(timeout_s=2.0)
    table.heard(b"a", "reward-a", [bid], leaving=False)
    assert list(table.update()) == [b"a"]
    clock.now += 0.4
    table.heard(b"a", "reward-a", [bid], leaving=False)
    assert table.update() == {}  # unchanged and fresh
    clock.now += 0.2  # 0.6 s > timeout / 4: renewed
    table.heard(b"a", "reward-a", [bid], leaving=False)
    assert list(table.update()) == [b"a"]
    table.unsent(b"a")  # the send failed: again on the next turn
    assert list(table.update()) == [b"a"]


def test_a_worker_not_using_a_budget_gets_no_share_of_it():
    table, budgets, _clock, bid = owner_table()
    table.heard(b"rules", "reward-rules", [], leaving=False)
    assert table.update()[b"rules"].shares == [] and budgets.limiters[bid].share.rpm == 600.0


def test_a_hot_plugged_worker_keeps_to_the_unleased_share_until_its_lease_and_after_it_runs_out():
    peer = RateBudgets()
    limiter = peer.limiter(JsonScorerConfig(url=URL, api_key_env="JUDGE_KEY", concurrency=16, rpm=800.0, tpm=8000.0))
    peer.apply_fraction(0.125)
    assert (limiter.share.concurrency, limiter.share.rpm, limiter.share.tpm) == (2, 100.0, 1000.0)
    bid = budget_id(URL, "JUDGE_KEY")
    lease = RateLease(shares=[RateShare(budget=bid, concurrency=8, rpm=400.0, tpm=4000.0)], workers=2)
    peer.apply_lease(decode(encode(lease))[1], unleased_share=0.125, now=10.0)
    assert (limiter.share.concurrency, limiter.share.rpm, limiter.slots.limit, limiter.rpm.rate) == (
        8,
        400.0,
        8,
        400 / 60,
    )
    assert not peer.expire(timeout_s=2.0, unleased_share=0.125, now=11.9)
    assert peer.expire(timeout_s=2.0, unleased_share=0.125, now=12.1)  # the owner went silent
    assert (limiter.share.concurrency, limiter.share.rpm) == (2, 100.0)
    too_much = RateLease(shares=[RateShare(budget=bid, concurrency=64, rpm=8000.0)], workers=1)
    peer.apply_lease(too_much, unleased_share=0.125, now=13.0)
    assert (limiter.share.concurrency, limiter.share.rpm) == (16, 800.0)  # never above its own config


def test_the_budget_is_the_key_variable_and_the_host_never_the_key(monkeypatch):
    monkeypatch.setenv("JUDGE_KEY", "sk-secret-value")
    bid = budget_id(URL, "JUDGE_KEY")
    assert bid == budget_id("https://JUDGE.example.com:443/other/path", "JUDGE_KEY")
    assert bid != budget_id(URL, "OTHER_KEY") and bid != budget_id("https://other.example.com/", "JUDGE_KEY")
    assert len(bid) == 12 and "secret" not in bid and "JUDGE" not in bid


def test_rewards_sharing_a_budget_must_state_it_alike():
    a = {"kind": "http_json", "name": "a", "options": {"url": URL, "api_key_env": "K", "rpm": 600}}
    b = {"kind": "openai_judge", "name": "b", "options": {"url": URL + "/chat", "api_key_env": "K", "rpm": 60}}
    with pytest.raises(ValidationError, match=r"rewards 'a' and 'b' call one host with one api_key_env.*\(32, 600.0"):
        RunConfig(reward={"rewards": [a, b]})
    b["options"]["rpm"] = 600
    RunConfig(reward={"rewards": [a, b]})  # alike: one budget, fine
    with pytest.raises(ValidationError, match=r"unleased_share"):
        RunConfig(reward={"unleased_share": 0})


def test_a_lease_with_an_impossible_share_is_rejected_on_the_wire():
    bad = encode(RateLease(shares=[RateShare(budget="b", concurrency=0)]))
    with pytest.raises(WireError):
        decode(bad)


def test_slots_shrunk_let_calls_in_flight_finish_and_start_none_until_below_the_new_limit():
    async def run():
        slots, peak, inside = Slots(4), [0], [0]

        async def call(hold: float):
            async with slots:
                inside[0] += 1
                peak[0] = max(peak[0], inside[0])
                await asyncio.sleep(hold)
                inside[0] -= 1

        first = [asyncio.ensure_future(call(0.05)) for _ in range(4)]
        await asyncio.sleep(0.01)
        slots.resize(1)
        peak[0] = 0
        rest = [asyncio.ensure_future(call(0.01)) for _ in range(4)]
        await asyncio.gather(*first)
        peak[0] = inside[0]
        await asyncio.gather(*rest)
        return peak[0], slots.used

    assert asyncio.run(run()) == (1, 0)
