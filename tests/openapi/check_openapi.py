#!/usr/bin/env python3
"""Checks the router's OpenAPI document (GET /openapi.json) against the router itself.

    check_openapi.py --url http://127.0.0.1:PORT --routes 'POST /generate,GET /info,...' \
        [--seed 1] [--max-examples 20] [--max-time 60] [--report-dir DIR] [--no-fuzz]

1. The document: OpenAPI 3.1, every schema a valid JSON Schema 2020-12, every $ref resolves,
   and its operations are exactly --routes (the router's route table, which the caller
   lists from the code: HttpFrontend::Routes()).
2. Real responses: a fixed set of requests to every operation, good and bad (each error the
   router answers that a test can provoke: 400, 403, 404, 405, 415, 422, 501 is the caller's), each
   response's status, Content-Type and body checked against the document; a server-sent
   event stream's every event's data against its contentSchema. Every
   operation must have had a 200 that validated.
3. schemathesis against the running router (--no-fuzz skips it): a bounded run with the
   seed printed, checks not_a_server_error, status_code_conformance,
   content_type_conformance and response_schema_conformance.

Prints one JSON object on its last line: {"routes", "responses_checked", "events_checked",
"failures": [...], "schemathesis": {"seed", "exit_code", "operations", "cases", "failures"}}.
Exit code 0 when nothing failed.
"""

import argparse
import http.client
import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import jsonschema
import referencing
import referencing.jsonschema

# unsupported_method is not one: a method libevent does not know (QUERY) is answered 501 or
# 400 before the router sees it (RFC 9110 wants 501 for an unrecognized method); a known
# method the route does not take gets 405, which check_responses() checks.
CHECKS = ("not_a_server_error,status_code_conformance,content_type_conformance,"
          "response_schema_conformance")


class Checker:
    def __init__(self, url, document):
        self.url = url
        self.document = document
        resource = referencing.Resource.from_contents(
            document, default_specification=referencing.jsonschema.DRAFT202012)
        self.registry = referencing.Registry().with_resource("urn:kvcm:openapi", resource)
        self.failures = []
        self.responses = 0
        self.events = 0
        self.ok_routes = set()

    def fail(self, what):
        print(f"check_openapi: FAIL {what}", flush=True)
        self.failures.append(what)

    def validate(self, instance, schema, where):
        # The schema's "#/components/..." references resolve against the document.
        validator = jsonschema.Draft202012Validator(
            {"$id": "urn:kvcm:probe", "allOf": [self._rebase(schema)]}, registry=self.registry)
        errors = sorted(validator.iter_errors(instance), key=lambda e: list(e.path))
        if errors:
            self.fail(f"{where}: {errors[0].message[:300]} at {list(errors[0].path)}")
            return False
        return True

    def _rebase(self, node):
        """`node` with its "#/..." references pointing into the document."""
        if isinstance(node, dict):
            return {k: ("urn:kvcm:openapi" + v if k == "$ref" and v.startswith("#") else self._rebase(v))
                    for k, v in node.items()}
        if isinstance(node, list):
            return [self._rebase(v) for v in node]
        return node

    def request(self, method, path, body=None, raw=None, headers=None):
        if raw is not None and len(raw) > (1 << 20):
            return self.request_too_large(method, path, len(raw))
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        req = urllib.request.Request(self.url + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        for name, value in (headers or {}).items():  # in place of the above, and of Host
            req.add_header(name, value)
        try:
            with urllib.request.urlopen(req, timeout=60) as reply:
                return reply.status, reply.headers.get("Content-Type"), reply.read()
        except urllib.error.HTTPError as error:
            return error.code, error.headers.get("Content-Type"), error.read()

    def request_too_large(self, method, path, length):
        """The headers of a body over the limit, without the body: the router answers them."""
        host = urllib.parse.urlsplit(self.url)
        connection = http.client.HTTPConnection(host.hostname, host.port, timeout=60)
        connection.putrequest(method, path)
        connection.putheader("Content-Type", "application/json")
        connection.putheader("Content-Length", str(length))
        connection.endheaders()
        reply = connection.getresponse()
        result = reply.status, reply.headers.get("Content-Type"), reply.read()
        connection.close()
        return result

    def check(self, method, path, body=None, want=None, raw=None, headers=None):
        """Sends the request; checks the response against the document. Returns its body."""
        status, content_type, data = self.request(method, path, body, raw, headers)
        where = f"{method} {path} {json.dumps(body)[:120] if body is not None else ''} -> {status}"
        self.responses += 1
        if want is not None and status != want:
            self.fail(f"{where}: wanted {want}: {data[:300]!r}")
        operation = self.document["paths"].get(self.documented_path(path), {}).get(method.lower())
        if operation is None:
            if status not in (404, 405):
                self.fail(f"{where}: an undocumented operation answered")
            return data
        response = operation["responses"].get(str(status))
        if response is None:
            self.fail(f"{where}: status {status} is not documented: {data[:300]!r}")
            return data
        content = response.get("content")
        if not content:
            if data:
                self.fail(f"{where}: documented without a body, got {data[:100]!r}")
            elif status == 200:
                self.ok_routes.add((method, self.documented_path(path)))
            return data
        media = (content_type or "").split(";")[0].strip()
        if media not in content:
            self.fail(f"{where}: Content-Type {content_type} is not documented ({list(content)})")
            return data
        spec = content[media]
        good = True
        if media == "application/json":
            try:
                good = self.validate(json.loads(data), spec["schema"], where)
            except ValueError as error:
                self.fail(f"{where}: not JSON: {error}")
                good = False
        elif media == "text/event-stream":
            good = self.check_events(data, spec, where)
        if good and status == 200:
            self.ok_routes.add((method, self.documented_path(path)))
        return data

    def documented_path(self, path):
        """The document's path of `path`: itself, or a templated one ("/v1/models/{model}")
        whose fixed part it starts with."""
        if path in self.document["paths"]:
            return path
        for documented in self.document["paths"]:
            fixed = documented.split("{", 1)[0]
            if "{" in documented and path.startswith(fixed) and len(path) > len(fixed):
                return documented
        return path

    def check_events(self, data, spec, where):
        # The media type's schema is each event's: {"data": a string}, the data JSON of its
        # contentSchema (under "else" where "[DONE]" may end the stream).
        data_schema = spec["schema"].get("properties", {}).get("data", {})
        event_schema = data_schema.get("contentSchema", data_schema.get("else", {}).get("contentSchema"))
        if event_schema is None:
            self.fail(f"{where}: a stream whose events' data has no contentSchema")
            return False
        good = True
        events = [e for e in data.decode("utf-8", "replace").split("\n\n") if e.strip()]
        if not events:
            self.fail(f"{where}: an empty stream")
        for event in events:
            if not event.startswith("data:"):
                self.fail(f"{where}: an event that is not data: {event[:100]!r}")
                good = False
                continue
            payload = event[len("data:"):].strip()
            if payload == "[DONE]" and "else" in data_schema:
                continue
            self.events += 1
            try:
                good &= self.validate(json.loads(payload), event_schema, f"{where} event")
            except ValueError as error:
                self.fail(f"{where}: an event that is not JSON: {error}")
                good = False
        return good


def check_document(checker, routes):
    document = checker.document
    if not str(document.get("openapi", "")).startswith("3.1"):
        checker.fail(f"openapi is {document.get('openapi')!r}, not 3.1")
    for name, schema in document.get("components", {}).get("schemas", {}).items():
        try:
            jsonschema.Draft202012Validator.check_schema(schema)
        except jsonschema.SchemaError as error:
            checker.fail(f"components.schemas.{name}: {error.message}")
    # Every $ref resolves.
    def refs(node):
        if isinstance(node, dict):
            for k, v in node.items():
                if k == "$ref":
                    yield v
                else:
                    yield from refs(v)
        elif isinstance(node, list):
            for v in node:
                yield from refs(v)
    resolver = checker.registry.resolver()
    for ref in set(refs(document)):
        try:
            resolver.lookup("urn:kvcm:openapi" + ref)
        except Exception as error:  # noqa: BLE001: any failure to resolve is the finding
            checker.fail(f"$ref {ref} does not resolve: {error}")
    documented = {f"{method.upper()} {path}" for path, ops in document["paths"].items()
                  for method in ops}
    for route in sorted(routes - documented):
        checker.fail(f"the router serves {route}, the document does not have it")
    for route in sorted(documented - routes):
        checker.fail(f"the document has {route}, the router does not serve it")


def check_body_not_smuggled(c):
    """Found by schemathesis: libevent reads no body of a TRACE or HEAD request, so one sent
    with a body had it parsed as the next request of the connection (answered 501 or 400, or
    run). The router's framing refuses such a request (400, ambiguous framing) and closes the
    connection after its reply: one response, then EOF."""
    host = urllib.parse.urlsplit(c.url)
    for method in ("TRACE", "HEAD"):
        smuggled = b'GET /info HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n'
        head = (f"{method} /tokenize HTTP/1.1\r\nHost: {host.netloc}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(smuggled)}\r\n\r\n").encode()
        # A bound, not a measure: the router closes at once after its reply.
        with socket.create_connection((host.hostname, host.port), timeout=60) as s:
            s.sendall(head + smuggled)
            received = b""
            try:
                while chunk := s.recv(65536):
                    received += chunk
            except socket.timeout:
                c.fail(f"{method} with a body: the connection stayed open after the reply")
        c.responses += 1
        replies = received.count(b"HTTP/1.1 ")
        if replies != 1 or not received.startswith(b"HTTP/1.1 400"):
            c.fail(f"{method} with a body: wanted one 400 and the connection closed, got "
                   f"{replies} replies: {received[:200]!r}")


def check_responses(c, info):
    limit = info["max_total_tokens"]
    c.check("GET", "/health", want=200)
    c.check("GET", "/info", want=200)
    c.check("GET", "/metrics", want=200)
    c.check("GET", "/dashboard", want=200)
    c.check("GET", "/dashboard/state", want=200)
    c.check("GET", "/openapi.json", want=200)
    models = json.loads(c.check("GET", "/v1/models", want=200))
    c.check("GET", "/v1/models/" + urllib.parse.quote(models["data"][0]["id"], safe=""), want=200)
    c.check("GET", "/v1/models/no-such-model", want=404)
    c.check("POST", "/v1/models/no-such-model", want=405)
    c.check("POST", "/tokenize", {"inputs": "Hello"}, want=200)
    c.check("POST", "/tokenize", {"inputs": 5}, want=422)
    c.check("POST", "/tokenize", raw=b"not json", want=422)
    gen = {"inputs": "The OpenAPI test", "parameters": {"max_new_tokens": 4}}
    details = {"inputs": "The OpenAPI test", "parameters": {
        "max_new_tokens": 4, "details": True, "decoder_input_details": True, "top_n_tokens": 2}}
    best_of = {"inputs": "The OpenAPI test", "parameters": {
        "max_new_tokens": 3, "details": True, "do_sample": True, "best_of": 2}}
    c.check("POST", "/generate", gen, want=200)
    c.check("POST", "/generate", details, want=200)
    c.check("POST", "/generate", best_of, want=200)
    c.check("POST", "/generate", {"inputs": "x", "parameters": {"stop": ["a", "b"], "max_new_tokens": 8}}, want=200)
    c.check("POST", "/generate_stream", gen, want=200)
    c.check("POST", "/generate_stream", {"inputs": "x", "parameters": {"max_new_tokens": 3, "top_n_tokens": 2}}, want=200)
    c.check("POST", "/", gen, want=200)
    c.check("POST", "/", dict(gen, stream=True), want=200)
    c.check("POST", "/generate", raw=b"[1, 2", want=400)
    c.check("POST", "/generate", {"inputs": 1}, want=422)
    c.check("POST", "/generate", {"inputs": "x", "parameters": {"max_new_tokens": limit + 1}}, want=422)
    c.check("POST", "/generate", {"inputs": "x", "parameters": {"typical_p": 0.5}}, want=422)
    c.check("POST", "/generate", {"inputs": "x" * (info["max_input_tokens"] + 1)}, want=422)
    c.check("POST", "/", {"inputs": "x", "stream": "yes"}, want=422)
    c.check("GET", "/generate", want=405)
    c.check("GET", "/generate_stream", want=405)
    c.check("GET", "/", want=405)
    c.check("PUT", "/info", want=405)
    c.check("POST", "/health", want=405)
    c.check("GET", "/no/such/route", want=404)
    c.check("POST", "/generate", raw=b"{" + b" " * (1 << 20) + b"}", want=413)
    # What a page in a browser may send to any origin without a preflight, and a page
    # rebound to this address by DNS (its own name as the Host).
    c.check("POST", "/generate", gen, headers={"Content-Type": "text/plain"}, want=415)
    c.check("POST", "/tokenize", {"inputs": "a"}, headers={"Content-Type": "text/plain"}, want=415)
    c.check("POST", "/v1/completions", {"prompt": "a"},
            headers={"Content-Type": "application/x-www-form-urlencoded"}, want=415)
    c.check("GET", "/info", headers={"Host": "evil.example"}, want=403)
    c.check("POST", "/generate", gen, headers={"Host": "evil.example"}, want=403)
    c.check("GET", "/v1/models", headers={"Host": "evil.example"}, want=403)
    check_body_not_smuggled(c)
    # More than the pool can ever hold, within --max-total-tokens: refused before it is
    # queued, in each API's shape (OpenAI's was a 422, not its 400), streamed or not (a
    # stream was a 200 of one error event).
    pool = info["block_size"] * info["num_blocks"]
    if pool < limit:
        c.check("POST", "/generate", {"inputs": "x", "parameters": {"max_new_tokens": pool}}, want=422)
        c.check("POST", "/generate_stream", {"inputs": "x", "parameters": {"max_new_tokens": pool}}, want=422)
        c.check("POST", "/v1/completions", {"prompt": "x", "max_tokens": pool}, want=400)
        c.check("POST", "/v1/completions", {"prompt": "x", "max_tokens": pool, "stream": True}, want=400)
    else:
        c.fail(f"the pool ({pool} tokens) holds --max-total-tokens ({limit}): start it smaller")

    comp = {"model": "tiny", "prompt": "The OpenAPI test", "max_tokens": 4}
    c.check("POST", "/v1/completions", comp, want=200)
    c.check("POST", "/v1/completions", dict(comp, logprobs=2, echo=True), want=200)
    c.check("POST", "/v1/completions", dict(comp, prompt=[5, 6, 7], n=2, temperature=0.5), want=200)
    c.check("POST", "/v1/completions", dict(comp, stream=True, stream_options={"include_usage": True}), want=200)
    c.check("POST", "/v1/completions", dict(comp, stream=True, logprobs=1), want=200)
    c.check("POST", "/v1/completions", dict(comp, n=99), want=400)
    c.check("POST", "/v1/completions", dict(comp, prompt=[10 ** 6]), want=400)
    c.check("POST", "/v1/completions", raw=b"\"a string\"", want=400)
    c.check("GET", "/v1/completions", want=405)
    c.check("POST", "/v1/models", want=405)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    c.check("POST", "/v1/chat/completions", chat, want=200)
    c.check("POST", "/v1/chat/completions", dict(chat, logprobs=True, top_logprobs=2), want=200)
    c.check("POST", "/v1/chat/completions", dict(chat, stream=True, logprobs=True), want=200)
    c.check("POST", "/v1/chat/completions", dict(chat, messages=[{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]), want=200)
    c.check("POST", "/v1/chat/completions", dict(chat, messages=[]), want=400)
    c.check("POST", "/v1/chat/completions", dict(chat, top_logprobs=2), want=400)
    c.check("POST", "/v1/chat/completions", dict(chat, tools=[{"type": "function"}]), want=400)
    # Found by schemathesis: a content part whose "type" is no string threw (500).
    c.check("POST", "/v1/chat/completions", dict(chat, messages=[{"role": "user", "content": [
        {"type": {}, "text": ""}]}]), want=400)


def run_schemathesis(url, args):
    report_dir = Path(args.report_dir)
    report_dir.mkdir(parents=True, exist_ok=True)
    junit = report_dir / "schemathesis.xml"
    config = Path(__file__).resolve().parent / "schemathesis.toml"
    command = [sys.executable, "-m", "schemathesis.cli", "--config-file", str(config), "run",
               url + "/openapi.json",
               "--checks", CHECKS, "--seed", str(args.seed), "--max-examples", str(args.max_examples),
               "--max-time", str(args.max_time), "--workers", "1", "--request-timeout", "30",
               "--generation-database", "none", "--no-color", "--suppress-health-check", "all",
               "--report", "junit", "--report-junit-path", str(junit)]
    print("check_openapi: schemathesis seed", args.seed, ":", " ".join(command[1:]), flush=True)
    started = time.monotonic()
    run = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         timeout=args.max_time + 120)
    print(run.stdout, flush=True)
    result = {"seed": args.seed, "exit_code": run.returncode, "max_examples": args.max_examples,
              "seconds": round(time.monotonic() - started, 1)}
    # The JUnit report: one test case per operation, a failure per failed one.
    try:
        import xml.etree.ElementTree as ElementTree
        root = ElementTree.parse(junit).getroot()
        cases = root.findall(".//testcase")
        # "Stateful tests": the phase that chains operations through the document's links
        # (GET /v1/models -> GET /v1/models/{model}), reported as a case but no operation.
        result["stateful"] = any(t.get("name", "") == "Stateful tests" for t in cases)
        result["operations"] = sum(1 for t in cases if t.get("name", "") != "Stateful tests")
        result["operation_names"] = sorted(t.get("name", "") for t in cases
                                           if t.get("name", "") != "Stateful tests")
        result["failed_operations"] = sum(1 for t in cases if t.find("failure") is not None
                                          or t.find("error") is not None)
    except (OSError, ValueError) as error:
        result["report_error"] = str(error)
    # schemathesis's summary line, e.g. "N test cases generated, N passed".
    for line in run.stdout.splitlines():
        if "generated" in line and "passed" in line or "test cases" in line:
            result.setdefault("summary", []).append(line.strip())
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--routes", required=True, help="'METHOD /path,...': the route table")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--max-examples", type=int, default=20)
    parser.add_argument("--max-time", type=int, default=60)
    parser.add_argument("--report-dir", default="schemathesis-report")
    parser.add_argument("--no-fuzz", action="store_true")
    args = parser.parse_args()

    status, _, data = Checker(args.url, {}).request("GET", "/openapi.json")
    if status != 200:
        print(f"check_openapi: GET /openapi.json answered {status}")
        return 1
    checker = Checker(args.url, json.loads(data))
    routes = {r.strip() for r in args.routes.split(",") if r.strip()}
    check_document(checker, routes)
    info = json.loads(checker.request("GET", "/info")[2])
    check_responses(checker, info)
    for route in sorted(routes):
        method, path = route.split(" ", 1)
        if (method, path) not in checker.ok_routes:
            checker.fail(f"{route}: no 200 response validated")
    report = {"routes": len(routes), "responses_checked": checker.responses,
              "events_checked": checker.events, "failures": checker.failures}
    if not args.no_fuzz:
        report["schemathesis"] = run_schemathesis(args.url, args)
        if report["schemathesis"]["exit_code"] != 0:
            checker.failures.append("schemathesis found failures (its output above)")
    print(json.dumps(report))
    return 1 if checker.failures else 0


if __name__ == "__main__":
    sys.exit(main())
