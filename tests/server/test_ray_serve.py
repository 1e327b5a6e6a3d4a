"""`verispec serve --ray-replicas`: two Ray Serve replicas of the tiny model answer concurrent greedy requests with
the texts the single server gives, both take requests, errors keep the OpenAI shape, streams stream; without ray
the flag is one line and exit 2."""

from __future__ import annotations

import importlib.util
import socket
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from conftest import API_KEY, MODEL
from verispec.cli import main

MISSING = "/nonexistent/model-dir"  # never reached: refused before a model loads
APP_OPTIONS = dict(method="ngram", num_draft_tokens=4, max_num_seqs=8, kv_cache_tokens=4096, api_key=API_KEY)  # = app
needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                               reason="ray is not installed (pip install 'verispec[ray]')")
REQUESTS = [  # (chat?, prompt): greedy, as many as fit in both replicas' batches at once
    (False, "The quick brown fox"), (True, "Write a haiku."), (False, "a b a b a b a b"), (True, "hello hello"),
    (False, "def add(x, y):"), (True, "1, 2, 3, 4,"), (False, "Once upon a time"), (True, "Say something."),
]


@pytest.fixture(scope="module")
def ray_url(llm):
    import ray
    from ray import serve

    from verispec.server import ray_serve

    cpus = ray_serve.init_ray(num_cpus=2, log_to_driver=False)  # replicas' logs would reach capsys
    engine = dict(target=str(llm.target.source), dtype="float32", progress=False)
    app = ray_serve.application(engine, MODEL, APP_OPTIONS, replicas=2, cpus=cpus)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    try:
        yield ray_serve.deploy(app, "127.0.0.1", port)
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture
def ray_client(ray_url):
    return openai.OpenAI(base_url=f"{ray_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def ask(client, chat: bool, prompt: str, **kw):
    """(text, raw response) of one greedy request."""
    if chat:
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=12, temperature=0, **kw)
        return raw.parse().choices[0].message.content, raw
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, **kw)
    return raw.parse().choices[0].text, raw


@needs_ray
def test_replicas_answer_as_the_single_server_does(ray_client, client):
    """Every concurrent wave answers as the single server does; within three waves both replicas have answered
    (Ray's router picks a replica by its queue: on a busy CPU one wave may all go to one)."""
    expected = [ask(client, *r)[0] for r in REQUESTS]
    replicas = set()
    for _ in range(3):
        with ThreadPoolExecutor(len(REQUESTS)) as pool:
            answers = list(pool.map(lambda r: ask(ray_client, *r), REQUESTS))
        assert [text for text, _ in answers] == expected
        assert all(raw.http_response.status_code == 200 for _, raw in answers)
        replicas |= {raw.headers["x-verispec-replica"] for _, raw in answers}
        if len(replicas) == 2:
            break
    assert len(replicas) == 2, replicas  # one engine each, both used


@needs_ray
def test_streaming_through_the_proxy(ray_client, client):
    stream = ray_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello hello"}],
                                                max_tokens=12, temperature=0, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ask(client, True, "hello hello")[0]
    assert chunks[-1].choices[0].finish_reason == "length" and len(chunks) > 2


@needs_ray
def test_errors_keep_the_openai_shape(ray_url, ray_client):
    with pytest.raises(openai.NotFoundError) as e:
        ray_client.completions.create(model="nope", prompt="hi", max_tokens=2)
    assert e.value.response.json()["error"]["code"] == "model_not_found"
    assert "x-verispec-replica" in e.value.response.headers
    r = httpx.post(f"{ray_url}/v1/completions", json={"prompt": "hi"}, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


@needs_ray
def test_metrics_are_one_replicas_page(ray_url):
    r = httpx.get(f"{ray_url}/metrics")
    assert r.status_code == 200 and r.headers["x-verispec-replica"]
    assert f'verispec:generation_tokens_total{{model_name="{MODEL}"}}' in r.text


@needs_ray
def test_deployment_options():
    from verispec.server.ray_serve import deployment_options

    fixed = deployment_options(2, None, max_num_seqs=8, cpus=8)
    assert fixed["num_replicas"] == 2 and fixed["ray_actor_options"] == {"num_cpus": 4}
    assert fixed["max_ongoing_requests"] == 40  # the app's own running + waiting
    scaling = deployment_options(1, 4, max_num_seqs=8, cpus=8)
    assert "num_replicas" not in scaling and scaling["ray_actor_options"] == {"num_cpus": 2}
    assert scaling["autoscaling_config"] == dict(min_replicas=1, initial_replicas=1, max_replicas=4,
                                                 target_ongoing_requests=4)
    with pytest.raises(ValueError):
        deployment_options(2, 2, max_num_seqs=8, cpus=8)


@needs_ray
def test_cli_hands_the_options_to_ray_serve(monkeypatch):
    from verispec.server import ray_serve

    seen = {}
    monkeypatch.setattr(ray_serve, "run", lambda *a, **kw: seen.update(args=a, **kw))
    assert main(["serve", "--target", MISSING, "--method", "ar", "--ray-replicas", "2", "--ray-max-replicas", "3",
                 "--port", "8123", "--served-model-name", "mine"]) == 0
    engine, name, options = seen["args"]
    assert engine["target"] == MISSING and name == "mine" and options["method"] == "ar"
    assert (seen["replicas"], seen["max_replicas"], seen["host"], seen["port"]) == (2, 3, "127.0.0.1", 8123)


@pytest.mark.parametrize("flags,words", [
    (["--ray-replicas", "-1"], "--ray-replicas must be >= 0"),
    (["--ray-max-replicas", "2"], "--ray-max-replicas M needs"),
    (["--ray-replicas", "2", "--ray-max-replicas", "2"], "M > N"),
])
def test_bad_ray_flags_are_one_line_and_exit_2(capsys, flags, words):
    assert main(["serve", "--target", MISSING, *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("verispec: error: ") and err.count("\n") == 1 and words in err


def test_without_ray_the_flag_is_one_line_and_exit_2(capsys, monkeypatch):
    for name in ("ray", "ray.serve"):
        monkeypatch.setitem(sys.modules, name, None)  # import ... raises ImportError, as if not installed
    assert main(["serve", "--target", MISSING, "--ray-replicas", "1"]) == 2
    assert capsys.readouterr().err == ("verispec: error: verispec serve --ray-replicas needs ray: "
                                       "pip install 'verispec[ray]'\n")
