"""batch_rotating_rows: rows merged into a batch ring keep their first
tokens and their slack; extracting from an empty batch gives an empty row."""

import unittest

PROMPT_CACHE = "tests/test_prompt_cache.py"


class TestPromptCache(unittest.TestCase):
    def test_batch_rotating_rows_keep_their_first_tokens(self):
        # Keys are token ids: row i holds tokens 1, 2, ... in temporal order.
        rows = []
        for n in (5, 11):
            cache = RotatingKVCache(max_size=8, keep=2)
            x = mx.arange(1, n + 1, dtype=mx.float32).reshape(1, 1, n, 1)
            cache.update_and_fetch(x, x)
            rows.append(cache)
        batch = BatchRotatingKVCache.merge(rows)
        x = mx.array([6.0, 12.0]).reshape(2, 1, 1, 1)
        batch.update_and_fetch(x, x)

        row = batch.extract(0)
        self.assertEqual(row.keep, 2)
        self.assertEqual(row.keys[0, 0, :, 0].tolist(), [1, 2, 3, 4, 5, 6])
        row = batch.extract(1)
        self.assertEqual(row.keep, 2)
        self.assertEqual(row.keys[0, 0, :, 0].tolist(), [1, 2, 7, 8, 9, 10, 11, 12])

    def test_batch_rotating_rows_trim_back_their_slack(self):
        cache = RotatingKVCache(max_size=4, slack=2)
        x = mx.arange(1, 4, dtype=mx.float32).reshape(1, 1, 3, 1)
        cache.update_and_fetch(x, x)
        batch = BatchRotatingKVCache.merge([cache])
        for t in range(4, 8):
            x = mx.array([float(t)]).reshape(1, 1, 1, 1)
            batch.update_and_fetch(x, x)

        # Tokens 1 to 7, the window 4 to 7: two back, it is 2 to 5.
        row = batch.extract(0)
        self.assertEqual(row.trim(2), 2)
        self.assertEqual(row.offset, 5)
        self.assertEqual(sorted(row.keys[0, 0, :, 0].tolist()), [2, 3, 4, 5])

    def test_batch_rotating_extract_of_an_empty_cache(self):
        cache = BatchRotatingKVCache(max_size=8, left_padding=[1, 0])
        row = cache.extract(0)
        self.assertTrue(row.empty())
        self.assertEqual(row.offset, 0)


ADD = {PROMPT_CACHE: [TestPromptCache]}
