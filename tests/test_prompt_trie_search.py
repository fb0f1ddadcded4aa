"""prompt_trie_search: ``PromptTrie.search`` finds what upstream's finds
(exact, shorter, the shortest longer entry, ties broken alike) without a
copy of each node's path."""

import random

from mlx_lm.models.cache import PromptTrie

import mlx_lm_patched

upstream_search = mlx_lm_patched.get_original(
    "mlx_lm.models.cache:PromptTrie", "search"
)


def test_search_finds_what_upstreams_finds_in_random_tries():
    rng = random.Random(0)
    for _ in range(200):
        trie = PromptTrie()
        for _ in range(rng.randint(1, 8)):  # few tokens: shared prefixes, ties
            tokens = [rng.randint(0, 2) for _ in range(rng.randint(0, 12))]
            trie.add("m", tokens, len(tokens))
        for _ in range(10):
            query = [rng.randint(0, 2) for _ in range(rng.randint(0, 12))]
            assert trie.search("m", query) == upstream_search(trie, "m", query)
        assert trie.search("other", [1]) == upstream_search(trie, "other", [1])


def test_a_long_entry_met_early_is_found_whole():
    """A new conversation meeting a cached one at the chat template's first
    tokens: the entry found is the whole long one (upstream copied a list
    per node of it: seconds for 24k tokens)."""
    trie, long = PromptTrie(), list(range(24000))
    trie.add("m", long, "long")
    trie.add("m", long[:12] + [-1] * 40, "branch")
    result = trie.search("m", long[:12] + [-2, -3])
    assert (result.common_prefix, result.exact, result.shorter) == (12, None, None)
    assert result.longer == long[:12] + [-1] * 40  # the shorter of the two
    trie.pop("m", long[:12] + [-1] * 40)
    assert trie.search("m", long[:12] + [-2]).longer == long
