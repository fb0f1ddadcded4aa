"""first_token_early: a row's first token comes back before the next step."""

import unittest

GENERATE = "tests/test_generate.py"


class TestGenerate(unittest.TestCase):
    def test_batch_first_token_before_the_next_step(self):
        model, decode_calls = self.model, []

        class Counted:
            def __call__(self, inputs, *args, **kwargs):
                decode_calls.extend([1] if inputs.shape[1] == 1 else [])
                return model(inputs, *args, **kwargs)

            def __getattr__(self, name):
                return getattr(model, name)

        prompt = self.tokenizer.encode("Write a story about Einstein")
        gen = BatchGenerator(Counted())
        gen.insert([prompt], max_tokens=[4])
        while not gen.next_generated():
            pass
        # Only the step that made the first token is encoded
        self.assertEqual(len(decode_calls), 1)
        self.assertEqual(len(gen.next_generated()), 1)
        self.assertEqual(len(decode_calls), 3)

        # A row done at its first token holds that token's keys and values
        gen = BatchGenerator(model)
        gen.insert([prompt], max_tokens=[1])
        done = []
        while not done:
            done = [r for r in gen.next_generated() if r.finish_reason is not None]
        self.assertEqual(done[0].prompt_cache[0].offset, len(done[0].all_tokens))


ADD = {GENERATE: [TestGenerate]}
