"""batch_rotating_prealloc: the batch ring is allocated once; a loaded
batch cache continues like the one saved."""

import unittest

PROMPT_CACHE = "tests/test_prompt_cache.py"


class TestPromptCache(unittest.TestCase):
    def test_batch_rotating_cache_allocates_the_ring_once(self):
        cache = BatchRotatingKVCache(max_size=300, left_padding=[2, 0])
        x = mx.random.uniform(shape=(2, 2, 5, 8))
        cache.update_and_fetch(x, x)
        self.assertEqual(cache.keys.shape, (2, 2, 300, 8))

        for _ in range(400):
            x = mx.random.uniform(shape=(2, 2, 1, 8))
            k, v = cache.update_and_fetch(x, x)
            mx.eval(k, v)
            self.assertEqual(cache.keys.shape, (2, 2, 300, 8))

    def test_loaded_batch_rotating_cache_continues(self):
        cache = BatchRotatingKVCache(max_size=8, left_padding=[2, 0])
        x = mx.random.uniform(shape=(2, 2, 6, 8))
        cache.update_and_fetch(x, x)
        for _ in range(5):
            x = mx.random.uniform(shape=(2, 2, 1, 8))
            cache.update_and_fetch(x, x)

        cache_file = os.path.join(self.test_dir, "prompt_cache.safetensors")
        save_prompt_cache(cache_file, [cache])
        (loaded,) = load_prompt_cache(cache_file)

        x = mx.random.uniform(shape=(2, 2, 1, 8))
        mask = cache.make_mask(1)
        k, v = cache.update_and_fetch(x, x)
        lmask = loaded.make_mask(1)
        lk, lv = loaded.update_and_fetch(x, x)
        self.assertTrue(mx.array_equal(mask, lmask))
        self.assertTrue(mx.array_equal(k, lk))
        self.assertTrue(mx.array_equal(v, lv))


ADD = {PROMPT_CACHE: [TestPromptCache]}
EDIT = {
    PROMPT_CACHE: [
        # After filter the ring keeps its max_size slots: it was allocated
        # whole by the first update.
        (
            "        self.assertEqual(cache.keys.shape, (1, 1, 3, 8))\n",
            "        self.assertEqual(cache.keys.shape, (1, 1, 4, 8))\n",
        ),
        # The chunk after the wrapped decode drops the ring's oldest column,
        # a padding one: the row's first real token (column 2) stays in both
        # queries' window of 8; upstream's mask hid it.
        (
            "        mask = cache.make_mask(2)\n"
            "        expected = mx.array(\n"
            "            [\n"
            "                [False, False, False, True, True, True, True, True, False],\n"
            "                [False, False, False, True, True, True, True, True, True],\n",
            "        mask = cache.make_mask(2)\n"
            "        # The first real token (column 2) stays in both queries' window.\n"
            "        expected = mx.array(\n"
            "            [\n"
            "                [False, False, True, True, True, True, True, True, False],\n"
            "                [False, False, True, True, True, True, True, True, True],\n",
        ),
    ]
}
