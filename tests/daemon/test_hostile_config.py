"""Hostile configs, admins and reloads against a real `lb` (issue 13, cases 5 and 7):
credentials in URLs are refused and never shown, admin-added replica URLs are validated and
kept off link-local/metadata addresses, and a SIGHUP pointing at a broken file (not UTF-8, a
directory) keeps the running config with one clear log line."""
from __future__ import annotations

import signal
import subprocess

from tests.daemon.conftest import http_json, start_lb
from tests.procs import lb, poll


def check_config(path) -> subprocess.CompletedProcess:
    return subprocess.run(lb("check-config", str(path)), capture_output=True, text=True, timeout=30)


def test_credentials_in_a_replica_url_are_refused_naming_the_key_and_the_fix(tmp_path):
    cfg = tmp_path / "lb.toml"
    cfg.write_text('[[replicas]]\nurl = "http://user:hunter2@127.0.0.1:9"\n')
    r = check_config(cfg)
    assert r.returncode == 2 and "replicas[0].url" in r.stderr and "api_key" in r.stderr, r.stderr
    assert "hunter2" not in r.stderr + r.stdout
    cfg.write_text('[[peers]]\nregion = "eu"\nurl = "http://u:hunter2@127.0.0.1:9"\n[peering]\nregion = "us"\n'
                   'secret = "s"\n')
    r = check_config(cfg)
    assert r.returncode == 2 and "peers[0].url" in r.stderr and "hunter2" not in r.stderr, r.stderr


def test_check_config_masks_the_redis_password(tmp_path):
    cfg = tmp_path / "lb.toml"
    cfg.write_text('[state]\nbackend = "redis"\nurl = "redis://:hunter2@127.0.0.1:6379/0"\n'
                   '[[replicas]]\nurl = "http://127.0.0.1:9"\napi_key = "sk-replica"\n')
    r = check_config(cfg)
    assert r.returncode == 0, r.stderr
    assert "hunter2" not in r.stdout and "sk-replica" not in r.stdout
    assert "redis://:***@127.0.0.1:6379/0" in r.stdout


def test_admin_added_replica_urls_are_validated_and_metadata_is_denied(tmp_path):
    d = start_lb(ready=False)
    auth = {"Authorization": f"Bearer {d.token}"}
    try:
        for url in ("http://169.254.169.254", "http://169.254.169.254:80", "http://metadata.google.internal",
                    "http://[fe80::1]:8000", "http://[::ffff:169.254.169.254]:80", "http://127.0.0.1:70000",
                    "http://127.0.0.1:0", "http://127.0.0.1:8000/?x=1", "http://127.0.0.1:8000#frag",
                    "http://u:pw@127.0.0.1:8000", "ftp://127.0.0.1:21", "http://127.0.0.1:8000/v1"):
            status, doc = http_json("POST", d.url + "/admin/replicas", {"url": url}, auth)
            assert status == 400 and doc["error"]["code"] == "invalid_replica", (url, status, doc)
            assert "pw@" not in doc["error"]["message"]
        status, doc = http_json("POST", d.url + "/admin/replicas", {"url": "http://127.0.0.1:9"}, auth)
        assert status == 201, doc  # loopback stays allowed (tests and demos)
    finally:
        d.proc.stop()


def test_a_sighup_to_an_unreadable_config_keeps_the_running_one(tmp_path):
    cfg = tmp_path / "lb.toml"
    cfg.write_text('[[replicas]]\nurl = "http://127.0.0.1:9"\n')
    d = start_lb(config=cfg, ready=False)
    try:
        cfg.write_bytes(b'[[replicas]]\nurl = "http://127.0.0.1:9\xff\xfe"\n')  # not UTF-8
        d.proc.signal(signal.SIGHUP)
        poll(lambda: d.proc.log_path.read_text(errors="replace").count("reload failed") == 1, what="one reload line")
        cfg.unlink()
        cfg.mkdir()  # the path is now a directory
        d.proc.signal(signal.SIGHUP)
        poll(lambda: d.proc.log_path.read_text(errors="replace").count("reload failed") == 2, what="a second line")
        log = d.proc.log_path.read_text(errors="replace")
        assert "not UTF-8" in log and "is a directory" in log
        assert "Traceback" not in log and "UnicodeDecodeError" not in log
        assert http_json("GET", d.url + "/health")[0] == 200 and d.proc.popen.poll() is None
    finally:
        d.proc.stop()
