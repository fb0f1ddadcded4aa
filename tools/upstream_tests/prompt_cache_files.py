"""prompt_cache_files: load_prompt_cache says which file is wrong, and how."""

import unittest

PROMPT_CACHE = "tests/test_prompt_cache.py"


class TestPromptCache(unittest.TestCase):
    def test_load_prompt_cache_names_an_unknown_cache_class(self):
        cache_file = os.path.join(self.test_dir, "prompt_cache.safetensors")
        cache = KVCache()
        x = mx.random.uniform(shape=(1, 2, 4, 8))
        cache.update_and_fetch(x, x)
        save_prompt_cache(cache_file, [cache])
        arrays, metadata = mx.load(cache_file, return_metadata=True)
        metadata = {
            k: "FancyKVCache" if v == "KVCache" else v for k, v in metadata.items()
        }
        mx.save_safetensors(cache_file, arrays, metadata)

        with self.assertRaises(ValueError) as e:
            load_prompt_cache(cache_file)
        self.assertEqual(
            str(e.exception),
            f"{cache_file} names an unknown cache class 'FancyKVCache'",
        )

    def test_load_prompt_cache_rejects_a_weights_file(self):
        weights_file = os.path.join(self.test_dir, "weights.safetensors")
        mx.save_safetensors(weights_file, {"w": mx.zeros((2, 2))})
        with self.assertRaisesRegex(ValueError, "is not a prompt cache"):
            load_prompt_cache(weights_file)

    def test_load_prompt_cache_names_a_truncated_file(self):
        cache_file = os.path.join(self.test_dir, "prompt_cache.safetensors")
        cache = KVCache()
        x = mx.random.uniform(shape=(1, 2, 4, 8))
        cache.update_and_fetch(x, x)
        save_prompt_cache(cache_file, [cache])
        with open(cache_file, "rb") as f:
            data = f.read()
        with open(cache_file, "wb") as f:
            f.write(data[:-40])
        with self.assertRaisesRegex(ValueError, cache_file):
            load_prompt_cache(cache_file)

    def test_load_prompt_cache_rejects_a_float_offset(self):
        cache_file = os.path.join(self.test_dir, "prompt_cache.safetensors")
        cache = KVCache()
        x = mx.random.uniform(shape=(1, 2, 4, 8))
        cache.update_and_fetch(x, x)
        save_prompt_cache(cache_file, [cache])
        arrays, metadata = mx.load(cache_file, return_metadata=True)
        arrays["0.2"] = mx.array(4.0)
        mx.save_safetensors(cache_file, arrays, metadata)
        with self.assertRaisesRegex(ValueError, "scalar 0.2 is not one integer"):
            load_prompt_cache(cache_file)


ADD = {PROMPT_CACHE: [TestPromptCache]}
