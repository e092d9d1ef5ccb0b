"""A headless Chromium for the rollout inspector's page tests: the distribution's chromium and its chromedriver,
driven by Selenium (pinned in the dev lock). Outside CI, where they are missing, a test skips with one line saying
what to install; in CI (`CI=true`, where .ci/run installs them) a missing browser fails the test."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
INSTALL = "apt-get install chromium chromium-driver (the page tests' headless browser)"


def browser_paths() -> tuple[str, str] | None:
    """The browser's and its driver's executables, or None."""
    browser = next((found for name in BROWSERS if (found := shutil.which(name))), None)
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


def start_browser():
    """A headless Chromium (a Selenium driver) that keeps the page's console messages; skips or fails if none."""
    paths = browser_paths()
    if paths is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"no headless browser in CI: {INSTALL}")
        pytest.skip(f"no headless browser: {INSTALL}")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = paths[0]
    # root in CI and here: Chromium's sandbox refuses root; /dev/shm may be small in a container
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(argument)
    options.add_argument("--window-size=1400,900")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(options=options, service=Service(paths[1]))  # the driver given: nothing downloaded


def open_page(driver, path: Path, timeout_s: float = 30) -> float:
    """Load the page from disk and wait until its script has drawn it; returns the milliseconds that took."""
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(Path(path).resolve().as_uri())
    ready = WebDriverWait(driver, timeout_s).until(lambda d: d.execute_script("return window.inspectReady"))
    return ready["ms"]


def console_errors(driver) -> list[str]:
    """The page's console errors and uncaught exceptions since the last call."""
    return [entry["message"] for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


def set_value(driver, element_id: str, value: str) -> None:
    """Type into a filter as a person would: the value, then the event the page listens for."""
    driver.execute_script(
        "const e = document.getElementById(arguments[0]); e.value = arguments[1];"
        "e.dispatchEvent(new Event(e.tagName === 'SELECT' ? 'change' : 'input'));",
        element_id,
        value,
    )


def check_page(driver, run_dir: Path, screenshot: Path) -> dict:
    """The checks every real run's page passes, by the DOM (see tests/e2e/test_e2e.py): the step list, a step
    clicked, each of its samples' token count against its recorded length, masked tokens marked, a filter narrowing
    the list, no console errors, a token's figures on a click; and a screenshot. Returns what the page showed, for
    the caller's own checks."""
    from selenium.webdriver.common.by import By

    from rl_tpu.outputs import rollout_log
    from rl_tpu.outputs.metrics import read_metrics

    page = run_dir / "inspect.html"
    open_page(driver, page)
    steps = [int(row.get_attribute("data-step")) for row in driver.find_elements(By.CSS_SELECTOR, ".step-item")]
    assert steps == [row["step"] for row in read_metrics(run_dir / "metrics.jsonl")]
    record = rollout_log.read_steps(run_dir / "rollouts")
    # the last step with two prompts recorded or more (a search for one of them narrows the list), clicked
    shown_step = max(step for step, rows in record.items() if len({row["group"] for row in rows}) > 1)
    driver.find_element(By.CSS_SELECTOR, f'.step-item[data-step="{shown_step}"]').click()
    assert driver.find_element(By.CSS_SELECTOR, ".step-item.selected").get_attribute("data-step") == str(shown_step)
    recorded = record[shown_step]
    samples = driver.find_elements(By.CSS_SELECTOR, "#groups .sample")
    assert len(samples) == len(recorded) > 0
    in_order = [recorded[int(element.get_attribute("data-line"))] for element in samples]  # each one's line
    for element, row in zip(samples, in_order):
        tokens = element.find_elements(By.CSS_SELECTOR, ".tok")
        assert len(tokens) == int(element.get_attribute("data-len")) == len(row["output_ids"])
        masked = [i for i, tok in enumerate(tokens) if "masked" in tok.get_attribute("class").split()]
        assert masked == [j for j, m in enumerate(row["loss_mask"]) if not m]
    samples[0].find_element(By.CSS_SELECTOR, ".tok").click()  # a token's figures
    detail = driver.find_element(By.ID, "token-detail")
    assert detail.is_displayed() and "engine logprob" in detail.text
    assert f"1 of {len(in_order[0]['output_ids'])}" in detail.text
    driver.save_screenshot(str(screenshot))
    needle = in_order[0]["input"].strip().lower()  # the text search, for the first group's prompt: its samples only
    set_value(driver, "search", needle)
    narrowed = len(driver.find_elements(By.CSS_SELECTOR, "#groups .sample"))
    assert narrowed == sum(needle in (row["input"] + "\n" + row["output"]).lower() for row in recorded) < len(recorded)
    set_value(driver, "search", "")
    assert console_errors(driver) == []
    return {"step": shown_step, "recorded": in_order, "narrowed": narrowed}
