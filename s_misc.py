import json, re, socket, time, threading, httpx, openai
def rec(name, ok, info=""): print(("HELD  " if ok else "BROKEN"), name, info)
B8 = "http://127.0.0.1:23722"
c = openai.OpenAI(base_url=B8 + "/v1", api_key="x", max_retries=0)
outs = {}
def call(i):
    outs[i] = c.chat.completions.create(model="mock/m1", messages=[{"role": "user", "content": f"w{i}"}], extra_body={"conversation_id": "s-workers"}).choices[0].message.content
ths = [threading.Thread(target=call, args=(i,)) for i in range(8)]
for t in ths: t.start(); time.sleep(0.03)
for t in ths: t.join()
ns = sorted(int(re.match(r"echo\[(\d+)\]", v).group(1)) for v in outs.values())
rec("5.1 serialized across 2 workers", ns == list(range(1, 17, 2)), str(ns))
order_ok = all(int(re.match(r"echo\[(\d+)\]", outs[i]).group(1)) == 2 * i + 1 for i in range(8))
rec("5.1 arrival order across workers (30ms spacing)", order_ok, str(outs))
# 413 before read whole
s = socket.create_connection(("127.0.0.1", 23712))
s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 500000000\r\n\r\n{\"model\":")
s.settimeout(3)
try:
    data = s.recv(4096).decode(errors="replace")
    rec("5.1 413 before body read whole", data.startswith("HTTP/1.1 413"), data.splitlines()[0])
except socket.timeout:
    rec("5.1 413 before body read whole", False, "timeout waiting")
# GET response stream=true on non-background
B = "http://127.0.0.1:23712"
c1 = openai.OpenAI(base_url=B + "/v1", api_key="x", max_retries=0)
r = c1.responses.create(model="mock/m1", input="plain")
g = httpx.get(f"{B}/v1/responses/{r.id}", params={"stream": "true"})
rec("5.3 GET stored non-bg ?stream=true -> 400 (docs)", g.status_code == 400, f"{g.status_code} {g.text[:150]}")
# input_items pagination
cv = c1.conversations.create()
r = c1.responses.create(model="mock/m1", conversation=cv.id, input=[{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": "user", "content": "c"}])
p = c1.responses.input_items.list(r.id, limit=1, order="asc")
allx = [x.id for x in c1.responses.input_items.list(r.id, limit=1, order="asc")]
rec("5.3 input_items pagination", len(allx) == 3 and p.has_more, str(allx))
# unknown path 404 shape
u = httpx.get(B + "/v1/nope")
rec("5 unknown path 404 OpenAI shape", u.status_code == 404 and "error" in u.json(), u.text[:150])
