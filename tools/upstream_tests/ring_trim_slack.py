"""ring_trim_slack: a wrapped ring trims back within its slack exactly; a
trim it cannot do exactly keeps upstream's answer (0, nothing changed)."""

import unittest

PROMPT_CACHE = "tests/test_prompt_cache.py"


class TestPromptCache(unittest.TestCase):
    def test_trim_wrapped_rotating_cache_within_slack(self):
        cache = RotatingKVCache(max_size=8, keep=2, slack=3)
        x = mx.random.uniform(shape=(1, 2, 12, 8))
        cache.update_and_fetch(x, x)
        self.assertTrue(can_trim_prompt_cache([cache], 3))
        self.assertFalse(can_trim_prompt_cache([cache], 4))
        self.assertEqual(trim_prompt_cache([cache], 4), 0)
        self.assertEqual(cache.offset, 12)
        self.assertEqual(trim_prompt_cache([cache], 3), 3)
        self.assertEqual(cache.offset, 9)


ADD = {PROMPT_CACHE: [TestPromptCache]}
EDIT = {
    PROMPT_CACHE: [
        (
            "    RotatingKVCache,\n    load_prompt_cache,\n",
            "    RotatingKVCache,\n    can_trim_prompt_cache,\n    load_prompt_cache,\n",
        ),
    ]
}
