"""One choice's text as its tokens arrive (oxygen_torch/tools/serve/text.py): the deltas a stream
sends, joined, are the whole text; no half character is sent; the text stops before the first
stop string, even one split over tokens, and no part of it is sent first; EOS and max_tokens end
the row with their finish reason. A byte-level tokenizer (one token per UTF-8 byte) makes
characters split over tokens."""

from __future__ import annotations

import random

import pytest

from oxygen_torch.tools.serve.text import ChoiceText

EOS = 256


class Bytes:
    """Token i < 256 is the byte i; 256 is EOS (special: decoded to nothing)."""

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def feed(text: str, stop=(), max_tokens=1000, eos_at=None, prompt="> ", incremental=True):
    ids = list(text.encode())
    if eos_at is not None:
        ids.insert(eos_at, EOS)
    row = ChoiceText(Bytes(), list(prompt.encode()), max_tokens, tuple(stop), frozenset([EOS]),
                     incremental)  # fmt: skip
    deltas = []
    for t in ids:
        deltas.append(row.add(t))
        if row.finish:
            break
    deltas.append(row.end())
    return row, deltas


def test_deltas_join_to_the_text_and_no_half_character_is_sent():
    row, deltas = feed("héllo wörld ✓ done")
    assert "".join(deltas) == row.text == "héllo wörld ✓ done"
    assert not any("\ufffd" in d for d in deltas)
    assert row.finish == "length" or row.finish == "stop"  # ended by end(): the call returned
    assert len(row.ids) == len("héllo wörld ✓ done".encode())


def test_a_stop_string_split_over_tokens_ends_the_text_before_it_and_is_never_sent():
    row, deltas = feed("hello world", stop=("lo w", "zz"))
    assert row.text == "hel" and "".join(deltas) == "hel"
    assert row.finish == "stop" and row.stopped
    assert len(row.ids) == len("hello w")  # the token that completed the stop string counts


def test_the_first_stop_string_to_be_complete_wins():
    row, _ = feed("abcdefgh", stop=("fg", "cd"))
    assert row.text == "ab"
    row, _ = feed("abcdefgh", stop=("bcd", "c"))  # "c" is complete first
    assert row.text == "ab"


@pytest.mark.parametrize("incremental", [True, False])
def test_eos_ends_the_row_and_is_not_text(incremental):
    row, deltas = feed("abc", eos_at=2, incremental=incremental)
    assert row.text == "ab" == "".join(deltas)
    assert row.finish == "stop" and not row.stopped and row.ids[-1] == EOS


@pytest.mark.parametrize("incremental", [True, False])
def test_max_tokens_ends_the_row_with_length(incremental):
    row, deltas = feed("abcdef", max_tokens=3, incremental=incremental)
    assert row.text == "abc" == "".join(deltas) and row.finish == "length"
    assert row.add(ord("x")) == ""  # the engine pads a row that ended: ignored


@pytest.mark.parametrize("seed", range(5))
def test_a_row_decoded_once_at_its_end_has_the_streamed_text(seed):
    rng = random.Random(seed)
    text = "".join(rng.choice("ab é✓") for _ in range(rng.randrange(1, 40)))
    streamed, _ = feed(text, max_tokens=len(text.encode()) - seed)
    whole, deltas = feed(text, max_tokens=len(text.encode()) - seed, incremental=False)
    assert whole.text == streamed.text and whole.finish == streamed.finish
    assert deltas[:-1] == [""] * (len(deltas) - 1) and deltas[-1] == whole.text  # all at the end


@pytest.mark.parametrize("seed", range(20))
def test_random_text_and_stop_strings(seed):
    rng = random.Random(seed)
    alphabet = "ab é✓"
    text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 40)))
    stops = tuple({"".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 4)))
                   for _ in range(rng.randrange(0, 3))})  # fmt: skip
    row, deltas = feed(text, stop=stops)
    want, stopped = text, False
    for k in range(1, len(text) + 1):  # the first stop string to be complete ends the text
        hits = [i for i in (text[:k].find(s) for s in stops) if i >= 0]
        if hits:
            want, stopped = text[: min(hits)], True
            break
    assert row.text == want and "".join(deltas) == want
    assert not any("\ufffd" in d for d in deltas)
    assert row.stopped == stopped


def test_steps_the_event_loop_has_not_taken_yet_join_one_chunk():
    """jobs.Job: text of several steps put while the loop is busy reaches it as one item."""
    import asyncio

    import torch

    from oxygen_torch.tools.serve.jobs import Admission, Call, Job

    loop = asyncio.new_event_loop()
    try:
        call = Call([[1, 2]], 2, {})
        call.rows = [ChoiceText(Bytes(), [1, 2], 100) for _ in range(2)]
        admission = Admission(4)
        admission.enter()
        job = Job(call, admission, loop, stream=True)
        job.put(torch.tensor([[1, 2], [1, 2]]))  # the prompt
        for a, b in zip(b"hello", b"world"):
            job.put(torch.tensor([a, b]))
        loop.run_until_complete(asyncio.sleep(0))
        assert job.queue.qsize() == 1 and job.queue.get_nowait() == ("text", None)
        assert job.take_text() == ["hello", "world"]
        job.put(torch.tensor([ord("!"), ord("?")]))
        loop.run_until_complete(asyncio.sleep(0))
        assert job.queue.qsize() == 1 and job.take_text() == ["!", "?"]
        assert (admission.waiting, admission.running) == (0, 1)
    finally:
        loop.close()


def _bpe():
    """A byte-level BPE tokenizer trained here on a little text (special tokens included)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = ["héllo wörld, ünïcode — text 漢字 and emoji 🙂 " * 3, "the quick brown fox"] * 20
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(text, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>")  # fmt: skip


@pytest.mark.parametrize("kind", ["wordlevel", "bpe"])
def test_the_fast_decoder_is_the_tokenizers_own_decode(kind):
    """text.decoder(tok): the Rust tokenizer's decode for a fast tokenizer whose class keeps
    transformers' decoding, giving what tok.decode(ids, skip_special_tokens=True,
    clean_up_tokenization_spaces=False) gives on random ids (special tokens and split
    characters among them); a class that changes decoding keeps its own decode."""
    from tiny_tokenizer import tiny_tokenizer

    from oxygen_torch.tools.serve.text import decoder

    tok = tiny_tokenizer() if kind == "wordlevel" else _bpe()
    rng = random.Random(random.randrange(1 << 30))
    fast = decoder(tok)
    for _ in range(200):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randint(0, 12))]
        want = tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        assert fast(ids) == want, ids

    class Own(type(tok)):
        def _decode(self, token_ids, **kw):
            return "own:" + super()._decode(token_ids, **kw)

    own = Own(tokenizer_object=tok.backend_tokenizer)
    assert decoder(own)([3, 4]) == own.decode([3, 4], skip_special_tokens=True)
    assert decoder(own)([3, 4]).startswith("own:")


@pytest.mark.parametrize("kind", ["bytes", "bpe"])
@pytest.mark.parametrize("stop", [(), ("é ✓", "zz")])
def test_tokens_taken_a_wake_at_a_time_give_what_one_at_a_time_gives(kind, stop):
    """add_many() over random runs of tokens (the steps since a stream's last wake) gives the
    text, the deltas joined, the ids and the finish that add() token by token gives: with
    characters split over tokens, an EOS inside a run, max_tokens inside a run, and tokens
    after the end (the engine's padding)."""
    rng = random.Random(random.randrange(1 << 30))
    tok = Bytes() if kind == "bytes" else _bpe()
    eos = EOS if kind == "bytes" else tok.convert_tokens_to_ids("</s>")
    for _ in range(30):
        text = "".join(rng.choice("ab é✓漢🙂 ") for _ in range(rng.randrange(1, 30)))
        ids = list(text.encode()) if kind == "bytes" else tok.encode(text)
        if rng.random() < 0.4:
            ids.insert(rng.randrange(len(ids) + 1), eos)
        ids += [rng.randrange(200) for _ in range(rng.randrange(4))]  # (after an end)
        max_tokens = rng.randint(1, len(ids) + 2)
        prompt = list(b"> ") if kind == "bytes" else tok.encode("> ")
        rows = [ChoiceText(tok, prompt, max_tokens, stop, frozenset([eos])) for _ in range(2)]
        one = [rows[0].add(t) for t in ids] + [rows[0].end()]
        runs, i = [], 0
        while i < len(ids):
            n = rng.randint(1, 6)
            runs.append(rows[1].add_many(ids[i : i + n]))
            i += n
        runs.append(rows[1].end())
        a, b = rows
        assert "".join(runs) == "".join(one) == b.text == a.text, (ids, max_tokens)
        assert (a.ids, a.finish, a.stopped) == (b.ids, b.finish, b.stopped)


def test_posts_from_many_threads_reach_the_loop_in_order_in_few_wakes():
    """jobs.Poster: items posted from worker threads reach their queues on the event loop, each
    queue's in the order posted, none lost; items posted while the loop has not run yet share
    one wake-up of it."""
    import asyncio
    import threading

    from oxygen_torch.tools.serve.jobs import poster_for

    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    try:
        queues = asyncio.run_coroutine_threadsafe(_queues(16), loop).result(5)
        poster = poster_for(loop)
        assert poster_for(loop) is poster
        rng = random.Random(random.randrange(1 << 30))
        plans = [[rng.randrange(16) for _ in range(300)] for _ in range(8)]

        def work(t):
            for n, q in enumerate(plans[t]):
                poster.post(queues[q], (t, n))

        threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(10)
        got = asyncio.run_coroutine_threadsafe(_drain(queues), loop).result(5)
        for q in range(16):
            want = [(t, n) for t in range(8) for n, x in enumerate(plans[t]) if x == q]
            mine = got[q]
            assert sorted(mine) == sorted(want)
            for t in range(8):  # each thread's items to a queue: in its order
                seq = [n for tt, n in mine if tt == t]
                assert seq == sorted(seq)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        runner.join(5)
        loop.close()
    idle = asyncio.new_event_loop()  # a loop that has not run since: every post, one wake
    try:
        queues = idle.run_until_complete(_queues(3))
        poster = poster_for(idle)
        for n in range(60):
            poster.post(queues[n % 3], n)
        assert poster.wakes == 1 and all(q.empty() for q in queues)
        got = idle.run_until_complete(_drain(queues))
        assert got == [list(range(k, 60, 3)) for k in range(3)]
        poster.post(queues[0], "next")  # (drained: the next post wakes the loop again)
        assert poster.wakes == 2
    finally:
        idle.close()


async def _queues(n):
    import asyncio

    return [asyncio.Queue() for _ in range(n)]


async def _drain(queues):
    import asyncio

    await asyncio.sleep(0.05)
    out = []
    for q in queues:
        items = []
        while not q.empty():
            items.append(q.get_nowait())
        out.append(items)
    return out
