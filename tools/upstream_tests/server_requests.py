"""server_requests: a bad request gets a 400 naming the parameter, a body
over MAX_REQUEST_BYTES a 413, and the server goes on."""

import unittest

SERVER = "tests/test_server.py"


class TestServer(unittest.TestCase):
    def _post_raw(self, body, headers=None):
        conn = http.client.HTTPConnection("localhost", self.port, timeout=60)
        headers = {"Content-Length": str(len(body)), **(headers or {})}
        conn.request("POST", "/v1/completions", body, headers)
        response = conn.getresponse()
        status, text = response.status, response.read().decode()
        conn.close()
        return status, text

    def test_bad_parameters_are_rejected_naming_them(self):
        url = f"http://localhost:{self.port}/v1/completions"
        vocab_size = self.response_generator.model_provider.model.args.vocab_size
        valid = {"prompt": "hi", "max_tokens": 4, "temperature": 0.0}
        for name, value in [
            ("logit_bias", {str(vocab_size): 5.0}),
            ("logit_bias", {"-1": 5.0}),
            ("prompt", ""),
            ("top_k", 2**31),
            ("stop", [1, 2]),
            ("seed", -1),
            ("max_tokens", 2**63),
            ("max_tokens", True),
            ("repetition_context_size", 10**12),
        ]:
            body = {**valid, name: value}
            response = requests.post(url, json=body, timeout=60)
            self.assertEqual(response.status_code, 400, body)
            self.assertIn(name, response.json()["error"])
        response = requests.post(url, json=valid, timeout=60)
        self.assertEqual(response.status_code, 200)

    def test_bad_bodies_are_rejected(self):
        status, text = self._post_raw(b'{"prompt": "\xff"}')
        self.assertEqual(status, 400)
        self.assertIn("UTF-8", text)
        status, text = self._post_raw(b"[" * 100000 + b"]" * 100000)
        self.assertEqual(status, 400)
        self.assertIn("JSON", text)
        status, _ = self._post_raw(b"", {"Content-Length": str(10**12)})
        self.assertEqual(status, 413)
        status, _ = self._post_raw(b"", {"Content-Length": "-5"})
        self.assertEqual(status, 400)


ADD = {SERVER: [TestServer]}
