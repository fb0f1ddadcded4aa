"""host_export: prompt caches copied to host memory, bit for bit, and
saved from another thread."""

import unittest

PROMPT_CACHE = "tests/test_prompt_cache.py"


class TestPromptCache(unittest.TestCase):
    def test_prompt_cache_to_host_is_bit_exact(self):
        cache = [KVCache(), QuantizedKVCache(group_size=32, bits=4)]
        for c in cache:
            x = mx.random.normal(shape=(1, 2, 9, 32)).astype(mx.bfloat16)
            c.update_and_fetch(x, x)
        host = prompt_cache_to_host(cache, {"a": "b"})
        loaded, metadata = prompt_cache_from_host(host, return_metadata=True)
        self.assertEqual(metadata, {"a": "b"})
        for c, lc in zip(cache, loaded):
            self.assertIs(type(c), type(lc))
            self.assertEqual(c.offset, lc.offset)
            for a, b in zip(tree_flatten(c.state), tree_flatten(lc.state)):
                self.assertEqual(a[0], b[0])
                if isinstance(a[1], mx.array):
                    self.assertEqual(a[1].dtype, b[1].dtype)
                    self.assertTrue(mx.array_equal(a[1], b[1]))

    def test_host_prompt_cache_saves_on_another_thread(self):
        cache = make_prompt_cache(self.model)
        for c in cache:
            x = mx.random.normal(shape=(1, 2, 5, 8)).astype(mx.bfloat16)
            c.update_and_fetch(x, x)
        host = prompt_cache_to_host(cache)

        cache_file = os.path.join(self.test_dir, "prompt_cache.safetensors")
        thread = threading.Thread(target=host.save, args=(cache_file,))
        thread.start()
        thread.join()
        loaded = load_prompt_cache(cache_file)
        self.assertEqual(len(loaded), len(cache))
        for c, lc in zip(cache, loaded):
            self.assertEqual(lc.keys.dtype, mx.bfloat16)
            self.assertTrue(mx.array_equal(c.state[0], lc.state[0]))
            self.assertTrue(mx.array_equal(c.state[1], lc.state[1]))


ADD = {PROMPT_CACHE: [TestPromptCache]}
EDIT = {
    PROMPT_CACHE: [
        (
            "import tempfile\nimport unittest\n\nimport mlx.core as mx\n",
            "import tempfile\nimport threading\nimport unittest\n\n"
            "import mlx.core as mx\nfrom mlx.utils import tree_flatten\n",
        ),
        (
            "    make_prompt_cache,\n    save_prompt_cache,\n",
            "    make_prompt_cache,\n    prompt_cache_from_host,\n"
            "    prompt_cache_to_host,\n    save_prompt_cache,\n",
        ),
    ]
}
