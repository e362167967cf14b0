"""Opens weft's dashboard in headless Chromium (Debian's, driven by Playwright) as a
person would: gives the API key, waits for both nodes, chats, then watches a killed node
turn to lost. Writes screenshots at laptop and phone width.

usage: dashboard_browser.py URL KEY OUT_DIR NODE_PID PROMPT MAX_TOKENS
Prints one JSON line: the node cards, the topology's link labels and lines, the table of
what each node holds, the nodes' compute/network lines, the live table, the streamed
answer, the tok/s line, seconds until the node showed lost, console errors. Exits non-zero with the reason on a failed step.
"""

import json
import os
import signal
import sys
import time

from playwright.sync_api import sync_playwright

url, key, out_dir, node_pid, prompt, max_tokens = sys.argv[1:7]
os.makedirs(out_dir, exist_ok=True)
errors = []
with sync_playwright() as p:
    browser = p.chromium.launch(executable_path=os.environ.get("WEFT_CHROMIUM", "/usr/bin/chromium"),
                                args=["--no-sandbox"])
    page = browser.new_page(viewport={"width": 1366, "height": 900})
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url)
    # The server wants a key: the page asks for it before it connects.
    page.wait_for_selector("#keybox:not([hidden])", timeout=10_000)
    page.fill("#key", key)
    page.dispatch_event("#key", "change")
    page.wait_for_function("document.querySelectorAll('#nodes .node').length === 2", timeout=15_000)
    nodes = page.eval_on_selector_all("#nodes .node", "els => els.map(e => e.innerText)")
    # The topology: three boxes (the coordinator and two nodes), every pair a line labelled
    # with its measured round trip and bandwidth.
    page.wait_for_function("document.querySelectorAll('#topology .linklabel').length === 3", timeout=5_000)
    links = page.eval_on_selector_all("#topology .linklabel", "els => els.map(e => e.textContent)")
    lines = page.eval_on_selector_all("#topology line", "els => els.length")
    holds = page.eval_on_selector_all("#holds tr", "els => els.map(e => e.innerText)")
    predicted = page.text_content("#decode-vs")
    page.fill("#temperature", "0")
    page.fill("#maxtokens", max_tokens)
    page.fill("#prompt", prompt)
    page.click("#send")
    page.wait_for_function("document.querySelector('.speed') && /tokens/.test(document.querySelector('.speed').textContent)",
                           timeout=60_000)
    answer = page.text_content(".msg.assistant")
    speed = page.text_content(".speed")
    # The nodes worked: each one's share chart says how much of its time went to computing.
    page.wait_for_function("document.querySelectorAll('#shares .share').length === 2", timeout=5_000)
    shares = page.eval_on_selector_all("#shares .share", "els => els.map(e => e.textContent)")
    live = page.text_content("#live")
    page.screenshot(path=os.path.join(out_dir, "dashboard-laptop.png"), full_page=True)
    page.set_viewport_size({"width": 390, "height": 844})
    page.screenshot(path=os.path.join(out_dir, "dashboard-phone.png"), full_page=True)
    page.set_viewport_size({"width": 1366, "height": 900})
    os.kill(int(node_pid), signal.SIGKILL)
    killed = time.time()
    page.wait_for_selector("#nodes .node.lost", timeout=5_000)
    lost_after = time.time() - killed
    page.screenshot(path=os.path.join(out_dir, "dashboard-node-lost.png"), full_page=True)
    browser.close()
print(json.dumps({"nodes": nodes, "links": links, "lines": lines, "holds": holds, "predicted": predicted, "shares": shares,
                  "live": live, "answer": answer, "speed": speed, "lost_after_s": lost_after,
                  "errors": errors}))
