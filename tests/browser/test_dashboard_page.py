"""The dashboard in a real headless Chromium (`make test-browser`, not part of `make test`).

A real `kvserve serve` process, multi-turn chats over a shared system prompt through the official client,
and the page watched until it shows a non-zero hit rate and the system prompt's branch as a trunk with
the conversations nested under it, with no console errors. The screenshot goes to
build/test-browser/dashboard.png.
"""

import os
import sys
import time

import openai
import pytest
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By

from tests.helpers import free_port, server_process

pytestmark = pytest.mark.browser

OUTPUT = os.path.join(os.path.dirname(__file__), "..", "..", "build", "test-browser")
SYSTEM = (
    "You are the support assistant of a small bakery in Lyon. Answer briefly and kindly, in the "
    "customer's language, and never invent opening hours or prices you were not given."
)


def _driver() -> webdriver.Chrome:
    options = Options()
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1100"):
        options.add_argument(flag)
    options.binary_location = os.environ.get("CHROMIUM", "/usr/bin/chromium")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    service = Service(os.environ.get("CHROMEDRIVER", "/usr/bin/chromedriver"))
    return webdriver.Chrome(options=options, service=service)


def _wait_for(condition_met: "object", what: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if callable(condition_met) and condition_met():
            return
        time.sleep(0.5)
    raise AssertionError(f"the page never showed {what}")


def test_the_dashboard_shows_the_cache_at_work() -> None:
    port = free_port()
    argv = [sys.executable, "-m", "kvserve", "serve", "--port", str(port), "--kv-cache-memory", "256MiB"]
    with server_process([*argv, "--dashboard-show-text"], port) as (_, url):
        driver = _driver()
        try:
            driver.get(f"{url}/dashboard")
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
            model = client.models.list().data[0].id
            for user in ("Are you open on Sunday?", "Do you sell gluten-free bread?"):
                messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
                for follow_up in ("Thanks! And croissants?", "Great, see you then."):
                    reply = client.chat.completions.create(
                        model=model,
                        messages=messages,  # type: ignore[arg-type]
                        max_tokens=12,
                        temperature=0,  # type: ignore[arg-type]
                    )
                    messages += [
                        {"role": "assistant", "content": reply.choices[0].message.content or ""},
                        {"role": "user", "content": follow_up},
                    ]

            def hit_rate() -> float:
                return float(driver.find_element(By.ID, "hit-rate").get_attribute("data-rate") or 0)

            _wait_for(lambda: hit_rate() > 0, "a non-zero hit rate")
            rows = driver.find_elements(By.CSS_SELECTOR, "#prefix-tree tbody tr")
            _wait_for(
                lambda: any(
                    "support assistant" in r.text
                    for r in driver.find_elements(By.CSS_SELECTOR, "#prefix-tree tbody tr")
                ),
                "the system prompt's branch",
            )
            rows = driver.find_elements(By.CSS_SELECTOR, "#prefix-tree tbody tr")
            assert rows and "%" in driver.find_element(By.ID, "hit-rate-value").text

            def nested() -> bool:
                """The system prompt is a trunk row, and a row right under it (one level deeper) shows
                a conversation: where it parts from the trunk, not the system prompt's words again."""
                tree = [
                    (int(r.get_attribute("data-depth") or 0), r.text)
                    for r in driver.find_elements(By.CSS_SELECTOR, "#prefix-tree tbody tr")
                ]
                return any(
                    "support assistant" in text
                    and j + 1 < len(tree)
                    and tree[j + 1][0] == depth + 1
                    and "support assistant" not in tree[j + 1][1]
                    for j, (depth, text) in enumerate(tree)
                )

            _wait_for(nested, "the conversations nested under the system prompt")
            legend = driver.find_element(By.CSS_SELECTOR, "#pool-usage .legend").text
            assert "cached (evictable)" in legend and "free" in legend
            # Speculation is on by default: its card shows an acceptance rate, or "—" before any draft.
            assert driver.find_element(By.ID, "speculation").is_displayed()
            assert "(suffix)" in driver.find_element(By.ID, "speculation-method").text
            acceptance = driver.find_element(By.ID, "acceptance-value").text
            assert acceptance == "—" or acceptance.endswith("%")
            time.sleep(2)  # one more poll, so the chart holds the traffic's points
            os.makedirs(OUTPUT, exist_ok=True)
            driver.save_screenshot(os.path.join(OUTPUT, "dashboard.png"))
            errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]  # type: ignore[no-untyped-call]
            assert errors == []
        finally:
            driver.quit()
