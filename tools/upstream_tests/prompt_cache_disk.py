"""prompt_cache_disk: prompt caches on disk, found again after a restart,
corrupt files skipped with a warning, evicted entries read back."""

import unittest

PROMPT_CACHE = "tests/test_prompt_cache.py"


class TestPromptCache(unittest.TestCase):
    def test_disk_prompt_cache_survives_a_restart(self):
        cache = make_prompt_cache(self.model)
        for c in cache:
            x = mx.random.normal(shape=(1, 2, 10, 8)).astype(mx.bfloat16)
            c.update_and_fetch(x, x)
        directory = os.path.join(self.test_dir, "disk_restart")
        disk = DiskPromptCache(directory)
        disk.put("model", list(range(10)), cache)
        disk.close()

        disk = DiskPromptCache(directory)
        loaded, rest = disk.get("model", list(range(12)))
        self.assertEqual(rest, [10, 11])
        for c, lc in zip(cache, loaded):
            self.assertEqual(lc.keys.dtype, mx.bfloat16)
            self.assertTrue(mx.array_equal(c.state[0], lc.state[0]))
            self.assertTrue(mx.array_equal(c.state[1], lc.state[1]))
        self.assertIsNone(disk.get("other model", list(range(12))))
        disk.close()

    def test_disk_prompt_cache_skips_corrupt_files(self):
        directory = os.path.join(self.test_dir, "disk_corrupt")
        os.makedirs(directory)
        junk = os.path.join(directory, "junk.safetensors")
        with open(junk, "wb") as f:
            f.write(b"not a prompt cache")
        with self.assertLogs(level="WARNING") as logs:
            disk = DiskPromptCache(directory)
        self.assertIn(junk, logs.output[0])
        self.assertEqual(len(disk), 0)
        self.assertIsNone(disk.get("model", [1, 2, 3]))
        disk.close()

    def test_disk_prompt_cache_skips_an_edited_header(self):
        cache = [RotatingKVCache(max_size=4)]
        x = mx.random.normal(shape=(1, 2, 10, 8))
        cache[0].update_and_fetch(x, x)  # wrapped: it cannot be trimmed
        directory = os.path.join(self.test_dir, "disk_edited")
        disk = DiskPromptCache(directory)
        disk.put("model", list(range(10)), cache)
        disk.close()
        (name,) = os.listdir(directory)
        path = os.path.join(directory, name)
        with open(path, "rb") as f:
            data = f.read()
        with open(path, "wb") as f:  # the same length: only the manifest knows
            f.write(data.replace(b'"0.trimmable": "0"', b'"0.trimmable": "9"'))

        with self.assertLogs(level="WARNING") as logs:
            disk = DiskPromptCache(directory)
        self.assertIn("does not match its manifest", logs.output[0])
        self.assertIsNone(disk.get("model", [0, 1, 7]))
        disk.close()

    def test_disk_prompt_cache_never_opens_a_fifo(self):
        directory = os.path.join(self.test_dir, "disk_fifo")
        os.makedirs(directory)
        os.mkfifo(os.path.join(directory, "f" * 32 + ".safetensors"))
        with self.assertLogs(level="WARNING") as logs:
            disk = DiskPromptCache(directory)
        self.assertIn("not a regular file", logs.output[0])
        disk.close()

    def test_lru_prompt_cache_reads_evicted_entries_from_disk(self):
        disk = DiskPromptCache(os.path.join(self.test_dir, "disk_lru"))
        lru = DiskLRUPromptCache(disk, max_size=1)
        for tokens in ([1, 2, 3], [4, 5, 6]):
            cache = [KVCache()]
            x = mx.random.normal(shape=(1, 2, 3, 8))
            cache[0].update_and_fetch(x, x)
            lru.insert_cache("model", tokens, cache)
        disk.flush()

        cache, rest = lru.fetch_nearest_cache("model", [1, 2, 3, 7])
        self.assertEqual(rest, [7])
        self.assertEqual(cache[0].offset, 3)
        disk.close()


ADD = {PROMPT_CACHE: [TestPromptCache]}
EDIT = {
    PROMPT_CACHE: [
        (
            "from mlx_lm.utils import load\n",
            "from mlx_lm.models.prompt_cache_disk import DiskLRUPromptCache, "
            "DiskPromptCache\n"
            "from mlx_lm.utils import load\n",
        ),
    ]
}
