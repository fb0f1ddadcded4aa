"""server_kv_bits: the server keeps batching with --kv-bits."""

import unittest

SERVER = "tests/test_server.py"


class TestServerKVCacheQuantization(unittest.TestCase):
    def test_quantized_kv_keeps_batching(self):
        args = type("args", (object,), {"seed": None})
        self.assertTrue(self.response_generator._is_batchable(args))


ADD = {SERVER: [TestServerKVCacheQuantization]}
EDIT = {
    SERVER: [
        # Replaced by test_quantized_kv_keeps_batching.
        (
            "    def test_quantized_kv_disables_batching(self):\n"
            '        args = type("args", (object,), {"seed": None})\n'
            "        self.assertFalse(self.response_generator._is_batchable(args))\n"
            "\n",
            "",
        )
    ]
}
