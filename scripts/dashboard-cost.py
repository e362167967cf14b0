"""Measures what the dashboard costs decode: `weft bench serve` against one `weft serve`,
alternating runs without a browser and with the page open in headless Chromium
(Playwright), and prints each run's aggregate decode tok/s, the medians' ratio, and the
share of a core the browser used while the page was open (its cost on a shared machine).

usage: target/pyenv/bin/python scripts/dashboard-cost.py [ROUNDS] [SERVE FLAGS...]
"""

import json
import os
import statistics
import subprocess
import sys
import time

from playwright.sync_api import sync_playwright

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
flags = sys.argv[2:]
weft = "target/release/weft"
server = subprocess.Popen([weft, "serve", "--port", "0", *flags], stdout=subprocess.PIPE, text=True)
url = server.stdout.readline().strip().removeprefix("listening on ")
print(subprocess.run(["lscpu"], capture_output=True, text=True).stdout.split("Model name:")[1].split("\n")[0].strip())


def bench():
    out = subprocess.run([weft, "bench", "serve", "--url", url, "-c", "8", "-n", "64", "--json"],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def browser_cpu_s():
    """CPU seconds used so far by every Chromium process (the open page's whole cost)."""
    total = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read()
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if b"chrom" in cmd:
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def key_figure(r):
    # Eight streams' aggregate rate over the whole run (the window where all eight
    # decode at once is a fraction of a second, too short to compare 3 % on).
    return r["aggregate_tok_s"]


runs = {"without": [], "with page": []}
browser_share = []
try:
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"])
        for i in range(rounds):
            runs["without"].append(key_figure(bench()))
            page = browser.new_page()
            page.goto(url + "/")
            page.wait_for_selector("#nodes .node")
            time.sleep(2)
            c0, t0 = browser_cpu_s(), time.time()
            runs["with page"].append(key_figure(bench()))
            browser_share.append((browser_cpu_s() - c0) / (time.time() - t0))
            page.close()
        browser.close()
finally:
    server.kill()
for k, v in runs.items():
    print(f"{k}: {', '.join(f'{x:.1f}' for x in v)} tok/s, median {statistics.median(v):.1f}")
ratio = statistics.median(runs["with page"]) / statistics.median(runs["without"])
print(f"with the page open / without: {ratio:.3f}")
print(f"the browser with the page used {100 * statistics.median(browser_share):.1f} % of one core "
      f"during the runs (median)")
