// What the browser specs share: their settings from the environment, a
// check that fails with its message, and Debian's Chromium launched for a
// closed network.
import { chromium } from "playwright-core";

export function env(name) {
  const value = process.env[name];
  if (!value) throw new Error(`${name} is not set; run this through server/tests/dashboard_browser.rs`);
  return value;
}

export function check(condition, message) {
  if (!condition) throw new Error(message);
}

export function launch(executablePath) {
  return chromium.launch({
    executablePath,
    // The network here is closed: without these Chromium keeps trying to
    // reach its own services, and a root user needs --no-sandbox.
    args: ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-quic",
      "--no-first-run", "--disable-component-update", "--disable-sync"],
  });
}
