"""server_failures: a failing request fails alone, with an error to its
client; a non-stream request whose client left is cancelled."""

import unittest

SERVER = "tests/test_server.py"


class TestServerFailures(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.response_generator = ResponseGenerator(
            DummyModelProvider(), LRUPromptCache()
        )
        cls.httpd = http.server.ThreadingHTTPServer(
            ("localhost", 0),
            lambda *args, **kwargs: APIHandler(cls.response_generator, *args, **kwargs),
        )
        cls.port = cls.httpd.server_port
        cls.server_thread = threading.Thread(target=cls.httpd.serve_forever)
        cls.server_thread.daemon = True
        cls.server_thread.start()

    @classmethod
    def tearDownClass(cls):
        cls.httpd.shutdown()
        cls.httpd.server_close()
        cls.server_thread.join()
        cls.response_generator.stop_and_join()

    def test_failing_request_fails_alone(self):
        url = f"http://localhost:{self.port}/v1/completions"
        for body in [
            # The sampler raises in a batch step.
            {"prompt": "hi", "max_tokens": 4, "temperature": 1.0, "top_k": 10**9},
            # Nothing to prefill.
            {"prompt": "", "max_tokens": 4},
        ]:
            response = requests.post(url, json=body, timeout=60)
            self.assertIn(response.status_code, (400, 500))
            self.assertIn("error", response.json())
            self.assertTrue(self.response_generator.generation_available())
            valid = {"prompt": "hi", "max_tokens": 4}
            response = requests.post(url, json=valid, timeout=60)
            self.assertEqual(response.status_code, 200)

    def test_non_stream_request_is_cancelled_when_its_client_leaves(self):
        body = json.dumps({"prompt": "hi", "max_tokens": 10**6}).encode()
        with self.assertLogs(level="INFO") as logs:
            conn = http.client.HTTPConnection("localhost", self.port, timeout=60)
            conn.request("POST", "/v1/completions", body)
            time.sleep(0.5)
            conn.close()
            for _ in range(300):
                if any("client disconnected" in line for line in logs.output):
                    break
                time.sleep(0.1)
        self.assertTrue(any("client disconnected" in line for line in logs.output))


ADD = {SERVER: [TestServerFailures]}
