"""The server's prompt cache is given --prompt-cache-bytes and logs its exact size."""

import logging
import re
from types import SimpleNamespace

import mlx.core as mx
import pytest


def run_prompt_cache(monkeypatch, **cli_args):
    """The prompt cache ``server.run`` builds for ``cli_args``, its server
    and generation thread stopped."""
    from mlx_lm import server

    started = []
    monkeypatch.setattr(server, "_run_http_server", lambda *a: started.append(a[2]))
    provider = SimpleNamespace(
        cli_args=SimpleNamespace(**cli_args),
        load_default=lambda: None,
        reset=lambda: None,
    )
    server.run("127.0.0.1", 0, provider)
    (generator,) = started
    prompt_cache = generator.prompt_cache
    generator.stop_and_join()
    return prompt_cache


@pytest.mark.parametrize("side", ["patched", "upstream"])
def test_run_gives_the_prompt_cache_its_byte_budget(request, monkeypatch, side):
    request.getfixturevalue(side)
    prompt_cache = run_prompt_cache(
        monkeypatch,
        prompt_cache_size=7,
        prompt_cache_bytes=12345,
        prompt_cache_dir=None,
    )
    assert prompt_cache.max_size == 7
    assert (prompt_cache.max_bytes == 12345) == (side == "patched")


def test_logged_prompt_cache_size_is_exact(patched, caplog):
    from mlx_lm.models.cache import KVCache, LRUPromptCache
    from mlx_lm.server import ResponseGenerator

    cache = KVCache()
    cache.update_and_fetch(mx.ones((1, 2, 3, 8)), mx.ones((1, 2, 3, 8)))
    generator = ResponseGenerator.__new__(ResponseGenerator)
    generator.prompt_cache = LRUPromptCache()
    generator.prompt_cache.insert_cache("m", [1, 2, 3], [cache])
    with caplog.at_level(logging.INFO):
        generator._log_cache_stats()
    live = 2 * 2 * 3 * 8 * 4  # keys and values, heads, tokens, dim, float32
    assert f"Prompt Cache: 1 sequences, 0.00 GB ({live} B)" in caplog.text


def test_run_gives_the_prompt_cache_a_disk_tier_closed_at_the_end(
    patched, monkeypatch, tmp_path
):
    from mlx_lm.models.prompt_cache_disk import DiskLRUPromptCache

    directory = str(tmp_path / "prompts")
    prompt_cache = run_prompt_cache(
        monkeypatch,
        prompt_cache_size=7,
        prompt_cache_bytes=None,
        prompt_cache_dir=directory,
        prompt_cache_disk_bytes=999,
        prompt_cache_queue_bytes=1 << 20,
        prompt_cache_disk_block=256,
        kv_bits=8,
        kv_group_size=32,
    )
    assert isinstance(prompt_cache, DiskLRUPromptCache)
    assert prompt_cache.max_size == 7
    disk = prompt_cache.disk
    assert (disk.directory, disk.max_bytes) == (directory, 999)
    assert disk.queue_bytes == 1 << 20 and disk.block_tokens == 256
    # In every entry's key: entries of caches quantized otherwise are others.
    assert disk.scope.startswith("--kv-bits 8 --kv-group-size 32 --prompt-cache-bits")
    assert not disk._writer.is_alive()  # closed when run returned


@pytest.mark.parametrize("side", ["patched", "upstream"])
def test_main_takes_the_disk_tier_flags(request, monkeypatch, tmp_path, side):
    request.getfixturevalue(side)
    from mlx_lm import server

    ran = []
    monkeypatch.setattr(
        server, "run", lambda host, port, provider: ran.append(provider)
    )
    monkeypatch.setattr(server, "ModelProvider", lambda args: args)
    flags = ["--prompt-cache-dir", str(tmp_path), "--prompt-cache-disk-bytes", "2G"]
    monkeypatch.setattr("sys.argv", ["mlx_lm.server", *flags])
    if side == "upstream":
        with pytest.raises(SystemExit):
            server.main()
        return
    server.main()
    (args,) = ran
    assert (args.prompt_cache_dir, args.prompt_cache_disk_bytes) == (
        str(tmp_path),
        2 * 10**9,
    )
    assert args.prompt_cache_disk_block == 1024  # tokens a block file holds
    monkeypatch.setattr(
        "sys.argv", ["mlx_lm.server", *flags, "--prompt-cache-disk-block", "0"]
    )
    with pytest.raises(SystemExit):
        server.main()


SIZES = {
    "4096": 4096,
    "10K": 10**4,
    "4M": 4 * 10**6,
    "2G": 2 * 10**9,
    "2GB": 2 * 10**9,
    "1.5G": 15 * 10**8,
    "2MiB": 2 << 20,
}


@pytest.mark.parametrize("size", list(SIZES))
def test_size_flags_take_units(patched, monkeypatch, tmp_path, size):
    from mlx_lm import server

    ran = []
    monkeypatch.setattr(
        server, "run", lambda host, port, provider: ran.append(provider)
    )
    monkeypatch.setattr(server, "ModelProvider", lambda args: args)
    flags = ["--prompt-cache-bytes", size, "--prompt-cache-disk-bytes", size]
    monkeypatch.setattr("sys.argv", ["mlx_lm.server", *flags])
    server.main()
    (args,) = ran
    assert args.prompt_cache_bytes == args.prompt_cache_disk_bytes == SIZES[size]


@pytest.mark.parametrize("dir_flags", [[], ["--prompt-cache-dir"]])
def test_prompt_cache_bits_reach_the_prompt_cache_and_bad_bits_are_refused(
    patched, monkeypatch, tmp_path, capsys, dir_flags
):
    from mlx_lm import server

    provider, run = [], server.run
    monkeypatch.setattr(server, "run", lambda host, port, p: provider.append(p))
    monkeypatch.setattr(server, "ModelProvider", lambda args: args)
    flags = ["--prompt-cache-bits", "4", "--prompt-cache-group-size", "32"]
    flags += [*dir_flags, *([str(tmp_path)] if dir_flags else [])]
    monkeypatch.setattr("sys.argv", ["mlx_lm.server", *flags])
    server.main()
    args = vars(provider[0])
    monkeypatch.setattr(server, "run", run)
    prompt_cache = run_prompt_cache(monkeypatch, **args)
    assert (prompt_cache.bits, prompt_cache.group_size) == (4, 32)
    monkeypatch.setattr("sys.argv", ["mlx_lm.server", "--prompt-cache-bits", "3"])
    with pytest.raises(SystemExit):
        server.main()
    assert "--prompt-cache-bits: invalid choice: 3" in capsys.readouterr().err


@pytest.mark.parametrize("mode", [0o600, 0o640])
def test_disk_tier_files_and_directory_get_the_prompt_cache_mode(
    patched, load_tiny, tmp_path, mode
):
    """Entry files are written with ``mode`` (default 0600: they
    hold users' prompts), a directory made with x where it has r."""
    import os
    import stat

    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.models.prompt_cache_disk import DiskPromptCache

    model, _ = load_tiny("llama")
    cache = make_prompt_cache(model)
    model(mx.arange(100)[None], cache=cache)
    directory = tmp_path / "made" / "cache"
    umask = os.umask(0o022)
    try:
        kwargs = {} if mode == 0o600 else {"mode": mode}
        disk = DiskPromptCache(str(directory), **kwargs)
        disk.put(("tiny", None, None), list(range(100)), cache)
        disk.close()
    finally:
        os.umask(umask)
    modes = {stat.S_IMODE(p.stat().st_mode) for p in directory.iterdir()}
    assert os.listdir(directory) and modes == {mode}
    assert stat.S_IMODE(directory.stat().st_mode) == mode | (mode & 0o444) >> 2


@pytest.mark.parametrize("value", ["640", "abc", "400", "1777"])
def test_prompt_cache_mode_is_octal_and_the_owners(
    patched, monkeypatch, tmp_path, capsys, value
):
    from mlx_lm import server

    ran = []
    monkeypatch.setattr(
        server, "run", lambda host, port, provider: ran.append(provider)
    )
    monkeypatch.setattr(server, "ModelProvider", lambda args: args)
    directory = tmp_path / "cache"
    flags = ["--prompt-cache-dir", str(directory), "--prompt-cache-mode", value]
    monkeypatch.setattr("sys.argv", ["mlx_lm.server", *flags])
    if value != "640":
        with pytest.raises(SystemExit):
            server.main()
        assert "is not a file mode" in capsys.readouterr().err
        return
    server.main()
    (args,) = ran
    assert args.prompt_cache_mode == 0o640
    assert (directory.stat().st_mode & 0o777) == 0o750


def restarted_on(load_tiny, directory):
    """``(tier, key, tokens)``: a ``DiskLRUPromptCache`` restarted on
    ``directory``, where one before it stored a 40-token prompt."""
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.models.prompt_cache_disk import DiskLRUPromptCache, DiskPromptCache

    model, _ = load_tiny("llama")
    cache = make_prompt_cache(model)
    model(mx.arange(40)[None], cache=cache)
    key, tokens = ("tiny", None, None), list(range(40))
    before = DiskLRUPromptCache(DiskPromptCache(str(directory)))
    before.insert_cache(key, tokens, cache)
    before.disk.close()
    return DiskLRUPromptCache(DiskPromptCache(str(directory))), key, tokens


def test_a_disk_hit_is_kept_in_memory_so_a_repeat_is_a_memory_hit(
    patched, load_tiny, tmp_path, caplog
):
    """After a restart, the first fetch of a prompt reads it from disk; the
    next is served from memory (it was read from disk every time), and the
    log says which tier served it."""
    restarted, key, tokens = restarted_on(load_tiny, tmp_path)
    with caplog.at_level(logging.INFO):
        for _ in range(2):
            fetched, rest = restarted.fetch_nearest_cache(key, tokens + [99])
            assert rest == [99] and fetched[0].offset == 40
    restarted.disk.close()
    tiers = [r.getMessage() for r in caplog.records if "Prompt cache" in r.getMessage()]
    assert len(tiers) == 2 and tiers[1] == "Prompt cache memory hit: 40 of 41 tokens"
    # What the restore read (the entry's file) and took: the cost model
    # learns the read, the request waits for all of it
    hit = re.fullmatch(
        r"Prompt cache disk hit: 40 of 41 tokens \(memory had 0; "
        r"read (\d+) B in ([\d.]+) s of ([\d.]+) s\)",
        tiers[0],
    )
    files = sum(f.stat().st_size for f in tmp_path.glob("*.safetensors"))
    assert hit and int(hit[1]) == files and float(hit[2]) <= float(hit[3])


def test_a_restore_costs_the_cost_model_all_the_request_waited(
    patched, load_tiny, tmp_path, monkeypatch
):
    """The read rate a restore teaches the cost model counts the whole disk
    hit, from the lookup to the working cache (the memory tier's copy, the
    working cache made), not the file's read alone."""
    import time

    restarted, key, tokens = restarted_on(load_tiny, tmp_path)
    restarted.disk.read_min_bytes = 0  # a 40-token entry teaches the rate
    working = restarted._working
    monkeypatch.setattr(restarted, "_working", lambda c: time.sleep(0.3) or working(c))
    restarted.fetch_nearest_cache(key, tokens + [99])
    read, seconds = restarted.disk.last_read
    assert seconds < 0.3 and read / restarted.disk.read_rate >= 0.3
    restarted.disk.close()


def test_a_small_restore_teaches_the_read_rate_nothing(patched, load_tiny, tmp_path):
    """A restore under ``read_min_bytes`` is served but not learned from:
    its fixed costs (an H200's first restore after a start: 1 MB in 0.15 s)
    made the next 0.9 GB entry look 115 s away, and it was recomputed."""
    restarted, key, tokens = restarted_on(load_tiny, tmp_path)
    assert restarted.fetch_nearest_cache(key, tokens + [99])[1] == [99]
    read, _ = restarted.disk.last_read
    assert 0 < read < restarted.disk.read_min_bytes
    assert restarted.disk.read_rate == restarted.disk.read_prior
    restarted.disk.close()


def test_a_conversation_sent_again_is_not_tokenized_again(patched, make_tiny_dir):
    """Agent loops resend the conversation and its system prompt: the tokens
    of a call seen before are kept (and handed out as copies), a new turn
    renders only the conversation, and another tokenizer's are not used."""
    from mlx_lm.server import ResponseGenerator
    from mlx_lm.utils import load_tokenizer

    def tokenizer():
        made = load_tokenizer(make_tiny_dir("llama"))
        calls, render = [], made.apply_chat_template
        made.apply_chat_template = lambda *a, **k: calls.append(a) or render(*a, **k)
        return made, calls, render

    generator = ResponseGenerator.__new__(ResponseGenerator)
    generator.model_provider = SimpleNamespace(
        processor=None, cli_args=SimpleNamespace(chat_template_args={})
    )
    args = SimpleNamespace(chat_template_kwargs=None)

    def tokenize(tok, messages):
        request = SimpleNamespace(
            request_type="chat", messages=messages, tools=None, role_mapping=None
        )
        return generator._tokenize(tok, request, args)[:3]

    tok, calls, render = tokenizer()
    system = {"role": "system", "content": "You answer in one word. " * 20}
    chat = [system, {"role": "user", "content": "Where is the sun?"}]
    prompt, segments, types = tokenize(tok, chat)
    assert prompt == render(chat, add_generation_prompt=True, tokenize=True)
    assert types == ["system", "user"] and len(calls) == 2
    prompt.append(-1)  # the caller's list, not the kept one
    assert tokenize(tok, chat) == (prompt[:-1], segments, types)
    assert len(calls) == 2
    turn = chat + [
        {"role": "assistant", "content": "Up."},
        {"role": "user", "content": "And the moon?"},
    ]
    assert tokenize(tok, turn)[0] == render(turn, add_generation_prompt=True)
    assert len(calls) == 3  # the system prompt's tokens were kept
    other, other_calls, _ = tokenizer()
    tokenize(other, chat)
    assert len(other_calls) == 2


def fast_tokenizers(make_tiny_dir):
    """Hugging Face fast tokenizers whose added tokens a resumed encoding
    must respect: the demo's byte-level BPE, and a Metaspace one that marks
    only its input's first word, with a normalizer and an added token that
    strips the space before it (no place to resume at)."""
    from tokenizers import (
        AddedToken,
        Tokenizer,
        models,
        normalizers,
        pre_tokenizers,
        trainers,
    )
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from mlx_lm_patched.demo import tiny

    spm = Tokenizer(models.BPE(unk_token="<unk>"))
    spm.normalizer = normalizers.Lowercase()
    spm.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>"])
    spm.train_from_iterator(tiny.TEXT.splitlines(), trainer)
    spm.add_special_tokens([AddedToken("<sep>", lstrip=True)])
    return {
        "bpe": AutoTokenizer.from_pretrained(make_tiny_dir("llama")),
        "metaspace": PreTrainedTokenizerFast(tokenizer_object=spm),
    }


@pytest.mark.parametrize("name", ["bpe", "metaspace"])
def test_a_resumed_encoding_is_the_whole_texts(patched, make_tiny_dir, name):
    """Texts grown, cut and edited anywhere (in words, special tokens, and
    spaces before a stripping token): ``encode_resumed`` from the text
    before gives the ids of encoding the text whole, and reuses the tokens
    before the last special token the two share."""
    import random

    from mlx_lm.server_prompt_cache import encode_resumed, resumable

    tok = fast_tokenizers(make_tiny_dir)[name]
    encoder = resumable(tok)
    assert encoder is not None
    words = ["the", " The", "cat", "  ", "\n", "é", "<s>", "<sep>", " <sep>", "x"]
    words += ["<|im_start|>", "<|im_end|>"] if name == "bpe" else []
    rng = random.Random(0)
    kept, reused = None, 0
    for _ in range(300):
        text = kept[0] if kept else ""
        at = rng.randrange(len(text) + 1)
        if rng.random() < 0.7:  # mostly grown at the end, as a chat grows
            at = len(text) - rng.randrange(min(len(text), 3) + 1)
        new = "".join(rng.choice(words) for _ in range(rng.randrange(12)))
        text = text[:at] + new
        ids, cuts = encode_resumed(encoder, text, [kept] if kept else [])
        assert ids == tok.encode(text, add_special_tokens=False)
        assert all(ids[i] in encoder[1] for i, _ in cuts)
        reused += kept is not None and ids[:1] == kept[1][:1] and len(cuts) > 1
        kept = (text, ids, cuts)
    assert reused > 100


def test_a_new_turn_encodes_its_new_messages_only(patched, make_tiny_dir, monkeypatch):
    """An agent's next turn (the conversation and two messages more) is
    encoded from the last special token it shares with the turn before:
    the tokens are ``apply_chat_template``'s, the text encoded is the new
    messages in their template, from the last turn's generation prompt on."""
    from mlx_lm import server
    from mlx_lm.server import ResponseGenerator
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(make_tiny_dir("llama"))
    encoded = []
    encoder, *cuts = server.resumable(tok)
    recording = SimpleNamespace(
        encode=lambda text, **k: encoded.append(text) or encoder.encode(text, **k)
    )
    monkeypatch.setattr(server, "resumable", lambda t: (recording, *cuts))
    generator = ResponseGenerator.__new__(ResponseGenerator)
    chat = [{"role": "system", "content": "You answer in one word. " * 50}]
    for turn in range(4):
        reply = {"role": "assistant", "content": f"Reply {turn}."}
        chat = (
            chat
            + ([reply] if turn else [])
            + [{"role": "user", "content": f"Tool result {turn}: " + "ok " * 40}]
        )
        kwargs = dict(add_generation_prompt=True, tokenize=True)
        ids = generator._chat_tokens(tok, chat, **kwargs)
        assert ids == tok.apply_chat_template(chat, **kwargs)
        if turn:
            new = sum(len(m["content"]) for m in chat[-2:])
            assert len(encoded) == turn + 1 and len(encoded[-1]) < new + 100
            assert encoded[-1].startswith("<|im_start|>assistant")


def test_a_requests_segment_caches_are_stored_after_its_first_token(
    patched, make_tiny_dir, caplog
):
    """The system prompt's cache (a segment ends within the prompt) is
    stored once the request's first token is out, not between its prompt's
    chunks: the first token's timing holds no insert, the store's does."""
    from mlx_lm.models.cache import LRUPromptCache
    from mlx_lm.server import CompletionRequest, ModelProvider, ResponseGenerator
    from ringref import cli_args, generation_args

    types = []

    class Recording(LRUPromptCache):
        def insert_cache(self, model, tokens, cache, *, cache_type="assistant"):
            types.append(cache_type)
            super().insert_cache(model, tokens, cache, cache_type=cache_type)

    provider = ModelProvider(cli_args(make_tiny_dir("llama")))
    generator = ResponseGenerator(provider, Recording())
    chat = [
        {"role": "system", "content": "You answer in one word. " * 20},
        {"role": "user", "content": "Why?"},
    ]
    with caplog.at_level(logging.DEBUG):
        try:
            request = CompletionRequest("chat", "", chat, None, None)
            _, responses = generator.generate(request, generation_args(3))
            assert len([r.token for r in responses]) == 3
        finally:
            generator.stop_and_join()  # its store line logged by then
    lines = [r.getMessage() for r in caplog.records]
    first = next(x for x in lines if "timing:" in x and "first_token=" in x)
    store = next(x for x in lines if "timing:" in x and "store=" in x)
    assert types == ["system", "user", "assistant"]
    assert "segments" not in first
    assert " fetch=" in first and " make=" in first  # lookup, then a new cache
    assert float(re.search(r"segments=([\d.]+)ms", store)[1]) > 0


def test_a_first_token_without_text_leaves_the_segments_for_the_next(
    patched, make_tiny_dir, monkeypatch
):
    """A first token that gives the client no text (a character's first
    byte) leaves the segment inserts for the token that does: the client's
    first text waits for the next step, which they would delay."""
    from mlx_lm.models.cache import LRUPromptCache
    from mlx_lm.server import CompletionRequest, ModelProvider, ResponseGenerator
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from ringref import cli_args, generation_args

    events = []

    class Quiet:  # the streaming detokenizer, no text until its second token
        def __init__(self, real):
            self.real, self.n = real, 0

        def add_token(self, token):
            self.n += 1
            events.append(("token", self.n))
            self.real.add_token(token)

        @property
        def last_segment(self):
            return self.real.last_segment if self.n > 1 else ""

        def __getattr__(self, name):
            return getattr(self.real, name)

    real = TokenizerWrapper.detokenizer
    monkeypatch.setattr(
        TokenizerWrapper, "detokenizer", property(lambda t: Quiet(real.fget(t)))
    )

    class Recording(LRUPromptCache):
        def insert_cache(self, model, tokens, cache, *, cache_type="assistant"):
            events.append(("insert", cache_type))
            super().insert_cache(model, tokens, cache, cache_type=cache_type)

    generator = ResponseGenerator(
        ModelProvider(cli_args(make_tiny_dir("llama"))), Recording()
    )
    chat = [
        {"role": "system", "content": "You answer in one word. " * 20},
        {"role": "user", "content": "Why?"},
    ]
    try:
        request = CompletionRequest("chat", "", chat, None, None)
        _, responses = generator.generate(request, generation_args(4))
        assert len([r.token for r in responses]) == 4
    finally:
        generator.stop_and_join()
    assert events[:4] == [
        ("token", 1),
        ("token", 2),
        ("insert", "system"),
        ("insert", "user"),
    ]
