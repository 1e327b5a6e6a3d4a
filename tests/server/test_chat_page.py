"""The chat page at / in a real browser (Debian's headless Chromium through Selenium): the reply is the API's text,
coloured by origin as the stream's ``verispec`` pieces say, the read-outs show numbers, Stop ends the request on the
server, and a wrong key shows the 401 message. Without chromium and chromedriver the browser tests skip, unless
VERISPEC_REQUIRE_BROWSER=1 (CI), where they fail."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import httpx
import pytest

from conftest import API_KEY, MODEL, metric

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
PROMPT = "abc abc abc abc abc abc"  # the n-gram drafter's proposals get accepted in the tiny model's reply
MAX_TOKENS = 96
WAIT_S = 20


def test_page_is_served_without_the_key(base_url):
    page = httpx.get(f"{base_url}/")
    script = httpx.get(f"{base_url}/chat.js")
    assert page.status_code == script.status_code == 200
    assert page.headers["content-type"].startswith("text/html") and '<script src="chat.js">' in page.text
    assert script.headers["content-type"].startswith("text/javascript") and "v1/chat/completions" in script.text
    assert "http" not in re.sub(r"https?://127\.0\.0\.1", "", page.text + script.text)  # nothing external


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        missing.append("the selenium package")
    if missing:
        reason = f"the chat page test needs {', '.join(missing)} (apt-get install chromium chromium-driver)"
        if os.environ.get("VERISPEC_REQUIRE_BROWSER") == "1":
            pytest.fail(reason + "; VERISPEC_REQUIRE_BROWSER=1 requires it")
        pytest.skip(reason)
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--window-size=1100,900", f"--user-data-dir={tmp_path_factory.mktemp('chromium')}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)
    driver.set_script_timeout(WAIT_S)
    yield driver
    driver.quit()


def open_page(driver, base_url: str, key: str, max_tokens: int = MAX_TOKENS):
    driver.get(f"{base_url}/")
    for field, value in [("key", key), ("temperature", "0"), ("max-tokens", str(max_tokens))]:
        box = driver.find_element("id", field)
        box.clear()
        box.send_keys(value)


def send(driver, prompt: str = PROMPT) -> None:
    from selenium.webdriver.common.keys import Keys

    driver.find_element("id", "prompt").send_keys(prompt, Keys.ENTER)  # Enter sends


def wait_for(condition, what: str, timeout: float = WAIT_S):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def reply(driver) -> dict:
    """The last assistant message: its text, its coloured spans ([class, text]), its note, and the read-outs."""
    return driver.execute_script("""
        const box = [...document.querySelectorAll('.msg.assistant')].pop();
        return box && {done: box.classList.contains('done'), error: box.classList.contains('error'),
                       text: box.querySelector('.body').textContent, note: box.querySelector('.note').textContent,
                       spans: [...box.querySelector('.body').children].map(s => [s.className, s.textContent]),
                       stats: document.getElementById('stats').textContent};""")


def api_spans(base_url: str, body: dict) -> list[list[str]]:
    """The streamed reply's pieces as the page should colour them: adjacent pieces of one origin joined."""
    spans = []
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json={**body, "stream": True},
                      headers={"Authorization": f"Bearer {API_KEY}"}, timeout=WAIT_S) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                for piece in json.loads(line[6:])["verispec"]["pieces"]:
                    kind = "draft" if piece["draft"] else "target"
                    if spans and spans[-1][0] == kind:
                        spans[-1][1] += piece["text"]
                    else:
                        spans.append([kind, piece["text"]])
    return spans


def test_reply_is_the_api_text_coloured_by_origin(browser, base_url, client, fixed_k):
    open_page(browser, base_url, API_KEY)
    send(browser)
    shown = wait_for(lambda: (r := reply(browser)) and r["done"] and r, "the reply to finish")
    body = dict(model=MODEL, messages=[{"role": "user", "content": PROMPT}], temperature=0, max_tokens=MAX_TOKENS)
    out = client.chat.completions.create(**body)
    stats = out.model_extra["metrics"]["speculative_decoding"]
    assert not shown["error"] and shown["note"] == f"finished: {out.choices[0].finish_reason}"
    assert shown["text"] == out.choices[0].message.content
    assert stats["num_accepted_tokens"] > 0
    assert {kind for kind, _ in shown["spans"]} == {"draft", "target"}
    assert shown["spans"] == api_spans(base_url, body)
    accepted = f"accepted / drafted {stats['num_accepted_tokens']} / {stats['num_draft_tokens']}"
    assert re.search(r"tokens/s \d+\.\d", shown["stats"]) and accepted in shown["stats"], shown["stats"]
    assert f"{out.usage.completion_tokens} completion tokens" in shown["stats"]


def test_stop_ends_the_request_on_the_server(browser, base_url, app, fixed_k, monkeypatch):
    engine = app.state.runner.engine
    step = engine.step
    monkeypatch.setattr(engine, "step", lambda: (time.sleep(0.05), step())[1])  # a reply that takes seconds
    open_page(browser, base_url, API_KEY, max_tokens=200)
    send(browser)
    live = wait_for(lambda: (r := reply(browser)) and "accepted / drafted" in r["stats"] and r, "live read-outs")
    assert re.search(r"tokens/s \d+\.\d .*accepted / drafted \d+ / \d+", live["stats"]), live["stats"]
    assert metric(httpx.get(f"{base_url}/metrics").text, "verispec:num_requests_running") == 1
    browser.find_element("id", "stop").click()
    stopped = wait_for(lambda: (r := reply(browser)) and r["done"] and r, "the page to stop")
    assert stopped["note"] == "stopped" and not stopped["error"]
    wait_for(lambda: metric(httpx.get(f"{base_url}/metrics").text, "verispec:num_requests_running") == 0,
             "the server to abort the request", timeout=5)
    assert app.state.runner.in_flight == 0


def test_wrong_key_shows_the_401_message(browser, base_url):
    open_page(browser, base_url, "wrong-key")
    browser.refresh()  # the key is kept in localStorage
    assert browser.find_element("id", "key").get_attribute("value") == "wrong-key"
    send(browser, "hi")
    shown = wait_for(lambda: (r := reply(browser)) and r["done"] and r, "the error")
    assert shown["error"] and shown["text"] == ""
    assert shown["note"].startswith("401: this server was started with --api-key"), shown["note"]


def test_json_mode_and_log_probabilities(browser, base_url, client, fixed_k):
    """JSON mode asks for a json_object reply, and with log-probabilities on the page shows each token of the reply
    with the API's log-probability; clicking one shows it and its alternatives."""
    open_page(browser, base_url, API_KEY, max_tokens=48)
    for box in ("json-mode", "logprobs"):
        browser.find_element("id", box).click()
    send(browser, "A record, please.")
    shown = wait_for(lambda: (r := reply(browser)) and r["done"] and r, "the reply to finish")
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A record, please."}],
                                         temperature=0, max_tokens=48, response_format={"type": "json_object"},
                                         logprobs=True, top_logprobs=5)
    assert not shown["error"] and shown["text"] == out.choices[0].message.content
    assert shown["text"].lstrip().startswith("{")
    chips = browser.execute_script("return [...document.querySelectorAll('.msg.assistant .tokens .lp')]"
                                   ".map(c => [c.dataset.token, Number(c.dataset.logprob)]);")
    want = out.choices[0].logprobs.content
    assert chips == [[t.token, t.logprob] for t in want]
    browser.find_element("css selector", ".msg.assistant .tokens .lp").click()
    info = browser.find_element("id", "token-info").text
    assert f"logprob {want[0].logprob:.4f}" in info and "alternatives:" in info
