"""The proxy's slot table (sippcache/proxy/slots.py): which slot a request gets, tenants, waiting,
servers going down and coming back. Pure asyncio: no server."""

from __future__ import annotations

import asyncio

import pytest

from sippcache.proxy.slots import MIN_GAIN, NoServer, QueueFull, SlotTable, reusable

PROMPT = tuple(range(100))


def run(coroutine: object) -> object:
    return asyncio.run(asyncio.wait_for(coroutine, timeout=30))  # type: ignore[arg-type]


def test_a_request_goes_to_the_slot_holding_its_longest_prefix() -> None:
    async def scenario() -> None:
        table = SlotTable([2, 2])
        table.slots[1].tokens = PROMPT[:40]
        table.slots[3].tokens = PROMPT[:70] + (999,)
        slot, held = await table.acquire(PROMPT, "")
        assert (slot.server, slot.id, held) == (1, 1, 70)
        slot, held = await table.acquire(PROMPT, "")  # the next best, while the first is busy
        assert (slot.server, slot.id, held) == (0, 1, 40)

    run(scenario())


def test_with_no_prefix_anywhere_the_least_loaded_server_gets_it() -> None:
    async def scenario() -> None:
        table = SlotTable([2, 2])
        first, _ = await table.acquire(PROMPT, "")
        second, _ = await table.acquire((7, 8, 9), "")
        assert first.server != second.server

    run(scenario())


def test_another_tenants_slot_counts_for_nothing() -> None:
    async def scenario() -> None:
        table = SlotTable([1])
        table.slots[0].tokens, table.slots[0].scope = PROMPT, "alice"
        slot, held = await table.acquire(PROMPT, "bob")
        assert held == 0 and slot.scope == "alice"  # the caller erases it before use

    run(scenario())


def test_requests_wait_for_a_free_slot_in_turn_and_a_full_queue_says_so() -> None:
    async def scenario() -> None:
        table = SlotTable([1], max_queue=1)
        slot, _ = await table.acquire(PROMPT, "")
        waiter = asyncio.ensure_future(table.acquire(PROMPT, ""))
        await asyncio.sleep(0.05)
        assert not waiter.done() and table.waiting == 1
        with pytest.raises(QueueFull):
            await table.acquire(PROMPT, "")
        await table.release(slot)
        again, _ = await waiter
        assert again is slot and again.busy

    run(scenario())


def test_a_server_going_down_fails_its_waiters_and_empties_its_slots() -> None:
    async def scenario() -> None:
        table = SlotTable([1])
        slot, _ = await table.acquire(PROMPT, "")
        slot.tokens = PROMPT
        waiter = asyncio.ensure_future(table.acquire(PROMPT, ""))
        await asyncio.sleep(0.05)
        await table.set_down(0, True)
        with pytest.raises(NoServer):
            await waiter
        assert slot.tokens == ()
        await table.release(slot)
        await table.set_down(0, False)
        assert (await table.acquire(PROMPT, ""))[0] is slot

    run(scenario())


def test_what_llama_server_can_reuse_of_a_state() -> None:
    assert reusable(stored=80, common=50, prompt=100, can_cut=True) == 50  # cut where the prompt parts
    assert reusable(stored=80, common=50, prompt=100, can_cut=False) == 0  # a recurrent state cannot be cut
    assert reusable(stored=80, common=80, prompt=100, can_cut=False) == 80  # extended at exactly its length
    assert reusable(stored=100, common=100, prompt=100, can_cut=False) == 0  # llama-server must evaluate one


def test_forgetting_a_servers_idle_slots_keeps_the_busy_ones_and_other_servers() -> None:
    async def scenario() -> None:
        table = SlotTable([2, 1])
        busy, _ = await table.acquire([1, 2, 3], "")
        busy.tokens = (1, 2, 3)
        idle = next(s for s in table.slots if s.server == busy.server and s is not busy)
        other = next(s for s in table.slots if s.server != busy.server)
        idle.tokens, other.tokens = (4, 5), (6, 7)
        await table.forget_idle(busy.server)
        assert (busy.tokens, idle.tokens, other.tokens) == ((1, 2, 3), (), (6, 7))

    run(scenario())


def test_a_client_slot_action_waits_for_its_slot_and_starves_no_request() -> None:
    """`take(wait=True)` waits while a request has the slot; a release wakes it and a request waiting
    for any slot alike (the wake-up one of them could have taken for itself goes to both)."""

    async def scenario() -> None:
        table = SlotTable([2])
        first, _ = await table.acquire(PROMPT, "")
        second, _ = await table.acquire(PROMPT, "")
        action = asyncio.ensure_future(table.take(first, wait=True))
        request = asyncio.ensure_future(table.acquire(PROMPT, ""))
        await asyncio.sleep(0.05)
        assert not action.done() and not request.done()
        assert await table.take(first) is False  # without wait: busy is a no
        await table.release(second)  # the request gets it; the action goes on waiting for its own
        assert (await request)[0] is second
        await asyncio.sleep(0.05)
        assert not action.done()
        await table.release(first)
        assert await action is True and first.busy
        assert table.find(0, 1) is second and table.find(0, 2) is None and table.find(1, 0) is None

    run(scenario())


def test_a_slot_action_waiting_on_a_server_that_goes_down_gives_up() -> None:
    async def scenario() -> None:
        table = SlotTable([1])
        slot, _ = await table.acquire(PROMPT, "")
        action = asyncio.ensure_future(table.take(slot, wait=True))
        await asyncio.sleep(0.05)
        await table.set_down(0, True)
        assert await action is False

    run(scenario())


def test_a_slot_holds_an_unknown_state_until_the_proxy_puts_one_there_or_it_is_emptied() -> None:
    """New slots (an attached llama-server's may hold anything) and forgotten ones are `unknown`,
    which another tenant erases first; a restarted server's or an erased slot is empty. An empty
    slot is picked before an unknown one."""

    async def scenario() -> None:
        table = SlotTable([2])
        assert all(s.unknown for s in table.slots)
        table.slots[1].forget(empty=True)
        assert not table.slots[1].unknown
        slot, _ = await table.acquire(PROMPT, "")
        assert slot is table.slots[1]
        slot.tokens = PROMPT
        slot.forget()
        assert slot.unknown and slot.tokens == ()
        await table.release(slot)
        await table.set_down(0, True)
        assert not any(s.unknown for s in table.slots)

    run(scenario())


def test_a_few_shared_tokens_do_not_take_a_conversations_slot_while_another_is_empty() -> None:
    """Two conversations over different system prompts share only the chat template's first tokens:
    the second goes to the empty slot, not to the first one's (which would be saved and later
    restored for nothing, turn after turn). A prefix worth a restore still wins."""

    async def scenario() -> None:
        table = SlotTable([2])
        first = table.slots[0]
        first.tokens, first.unsaved, first.unknown = PROMPT[:3] + tuple(range(500, 600)), 103, False
        table.slots[1].forget(empty=True)
        slot, held = await table.acquire(PROMPT, "")
        assert (slot, held) == (table.slots[1], 0)
        await table.release(slot)
        first.tokens = PROMPT[:MIN_GAIN] + tuple(range(500, 600))
        slot, held = await table.acquire(PROMPT, "")
        assert (slot, held) == (first, MIN_GAIN)

    run(scenario())
