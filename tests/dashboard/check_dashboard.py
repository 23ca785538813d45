#!/usr/bin/env python3
"""Opens the router's /dashboard in headless chromium and reports what a person would see.

    check_dashboard.py --url http://127.0.0.1:PORT/dashboard --screenshot out.png \
        --chromium /usr/bin/chromium --chromedriver /usr/bin/chromedriver [--min-polls 3]

Waits until the page has shown at least --min-polls states polled after it loaded, then
prints one JSON object on its last line:

  polls             states the page has shown
  counts            {state: the count its legend shows}
  cells, cols, pitch, blocks_per_cell   the block map canvas's layout (its data attributes)
  cell_states       {state: cells whose centre pixel has that state's legend colour}
  unmatched_cells   cells whose colour is no legend colour
  running, executors, sequences_rows, executor_rows, occupancy, hit_ratio, error
  console           the browser log's entries of level SEVERE or WARNING
  seconds           from the browser's start to the screenshot

The comparisons against /metrics are the caller's (tests/dashboard/dashboard_browser_test.cc).
Exit code 2 when the page never showed enough states in time.
"""

import argparse
import json
import sys
import time

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By

STATES = ["free", "in_use", "cached", "pinned", "quarantined", "draining"]

# Reads, in the page, the colour at the centre of every cell of the block map and the
# legend's colour of every state; returns per-state cell counts.
CELL_COLOURS = """
const canvas = document.getElementById("pool-map");
const n = Number(canvas.dataset.cells), cols = Number(canvas.dataset.cols);
const pitch = Number(canvas.dataset.pitch);
const g = canvas.getContext("2d");
const pixels = g.getImageData(0, 0, canvas.width, canvas.height).data;
const probe = document.createElement("canvas").getContext("2d", {willReadFrequently: true});
const legend = {};
for (const state of arguments[0]) {
  const swatch = document.getElementById("swatch-" + state);
  probe.fillStyle = getComputedStyle(swatch).backgroundColor;
  probe.fillRect(0, 0, 1, 1);
  const c = probe.getImageData(0, 0, 1, 1).data;
  legend[state] = [c[0], c[1], c[2]];
}
const counts = {};
for (const state of arguments[0]) counts[state] = 0;
let unmatched = 0;
for (let i = 0; i < n; ++i) {
  const x = (i % cols) * pitch + Math.floor((pitch - 1) / 2);
  const y = Math.floor(i / cols) * pitch + Math.floor((pitch - 1) / 2);
  const at = 4 * (y * canvas.width + x);
  let found = null;
  for (const state of arguments[0]) {
    const c = legend[state];
    if (c[0] === pixels[at] && c[1] === pixels[at + 1] && c[2] === pixels[at + 2]) found = state;
  }
  if (found === null) ++unmatched; else ++counts[found];
}
return {counts: counts, unmatched: unmatched, legend: legend};
"""


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--screenshot", required=True)
    parser.add_argument("--chromium", required=True)
    parser.add_argument("--chromedriver", required=True)
    parser.add_argument("--min-polls", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=20)
    args = parser.parse_args()

    started = time.monotonic()
    options = webdriver.ChromeOptions()
    options.binary_location = args.chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1280,1000", "--hide-scrollbars", "--force-device-scale-factor=1"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # The driver is named: Selenium Manager never runs (it would try to download one).
    driver = webdriver.Chrome(service=Service(executable_path=args.chromedriver),
                              options=options)
    try:
        driver.get(args.url)
        deadline = time.monotonic() + args.timeout
        polls = 0
        while time.monotonic() < deadline:
            polls = int(driver.execute_script("return Number(document.body.dataset.polls || 0)"))
            if polls >= args.min_polls:
                break
            time.sleep(0.1)
        if polls < args.min_polls:
            print(json.dumps({"polls": polls, "console": driver.get_log("browser")}))
            return 2

        def text(element_id):
            return driver.find_element(By.ID, element_id).text

        counts = {}
        for state in STATES:
            value = text("count-" + state)
            counts[state] = int(value) if value.isdigit() else value
        canvas = driver.find_element(By.ID, "pool-map")
        colours = driver.execute_script(CELL_COLOURS, STATES)
        report = {
            "polls": polls,
            "counts": counts,
            "cells": int(canvas.get_attribute("data-cells")),
            "cols": int(canvas.get_attribute("data-cols")),
            "pitch": int(canvas.get_attribute("data-pitch")),
            "blocks_per_cell": int(canvas.get_attribute("data-blocks-per-cell")),
            "cell_states": colours["counts"],
            "unmatched_cells": colours["unmatched"],
            "legend": colours["legend"],
            "running": text("running-count"),
            "executors": text("executor-count"),
            "sequences_rows": len(driver.find_elements(By.CSS_SELECTOR, "#sequences tbody tr")),
            "executor_rows": len(driver.find_elements(By.CSS_SELECTOR, "#executors tbody tr")),
            "occupancy": text("occupancy"),
            "hit_ratio": text("hit-ratio"),
            "cell_note": text("cell-note"),
            "error": text("error"),
        }
        driver.save_screenshot(args.screenshot)
        report["seconds"] = round(time.monotonic() - started, 2)
        report["console"] = [entry for entry in driver.get_log("browser")
                             if entry.get("level") in ("SEVERE", "WARNING")]
        print(json.dumps(report))
        return 0
    finally:
        driver.quit()


if __name__ == "__main__":
    sys.exit(main())
