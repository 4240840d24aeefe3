// Node's official gRPC client (@grpc/grpc-js, stubs from the .proto by @grpc/proto-loader) calling a
// Tulip: tests/test_interop.py runs `node interop.js TARGET CASES.json` and compares what it prints
// (one JSON line per case) with what grpcio's clients got from the same server.
//
// A case: {name, rpc: Embed | EmbedStream | Info | Check | Watch | RawEmbed, requests: [base64 of a
// serialized request], timeout_ms?, cancel_after_ms?}. Requests travel serialized so that Node sends
// exactly what Python built (decoded here with the proto's own deserializer, encoded again by
// grpc-js); replies come back serialized again by the proto's serializer (base64), or as {code,
// details} where the call failed. RawEmbed sends its bytes as they are (a message that is not an
// EmbedRequest).
"use strict";
const fs = require("fs");
const path = require("path");
const grpc = require("@grpc/grpc-js");
const loader = require("@grpc/proto-loader");

const [target, casesFile] = process.argv.slice(2);
const root = path.resolve(__dirname, "..", "..");
const opts = { keepCase: true, longs: Number, enums: Number, defaults: false, includeDirs: [path.join(root, "proto"), __dirname] };
const defs = loader.loadSync(["trellis/tulip/v1/tulip.proto", "health.proto"], opts);
const proto = grpc.loadPackageDefinition(defs);
const limits = { "grpc.max_receive_message_length": 64 << 20, "grpc.max_send_message_length": 64 << 20 };
const tulip = new proto.trellis.tulip.v1.Tulip(target, grpc.credentials.createInsecure(), limits);
const health = new proto.grpc.health.v1.Health(target, grpc.credentials.createInsecure());
const T = defs["trellis.tulip.v1.Tulip"], H = defs["grpc.health.v1.Health"];

const b64 = (buf) => Buffer.from(buf).toString("base64");
const failed = (err) => ({ code: err.code, details: err.details });
const deadline = (c) => (c.timeout_ms ? { deadline: new Date(Date.now() + c.timeout_ms) } : {});

function unary(client, method, def, c) {
  return new Promise((resolve) => {
    const req = def.requestDeserialize(Buffer.from(c.requests[0], "base64"));
    const call = client[method](req, deadline(c), (err, reply) =>
      resolve(err ? failed(err) : { reply: b64(def.responseSerialize(reply)) }));
    if (c.cancel_after_ms) setTimeout(() => call.cancel(), c.cancel_after_ms);
  });
}

function raw(c) {  // bytes as they are, through grpc-js's generic client (identity (de)serializers)
  return new Promise((resolve) => {
    const id = (x) => x;
    tulip.makeUnaryRequest("/trellis.tulip.v1.Tulip/Embed", id, id, Buffer.from(c.requests[0], "base64"),
      deadline(c), (err, reply) => resolve(err ? failed(err) : { reply: b64(reply) }));
  });
}

function stream(c) {
  return new Promise((resolve) => {
    const call = tulip.EmbedStream(deadline(c));
    const replies = [];
    call.on("data", (reply) => replies.push(b64(T.EmbedStream.responseSerialize(reply))));
    call.on("error", (err) => resolve({ replies, ...failed(err) }));
    call.on("status", (s) => { if (s.code === grpc.status.OK) resolve({ replies, code: 0 }); });
    for (const r of c.requests) call.write(T.EmbedStream.requestDeserialize(Buffer.from(r, "base64")));
    if (c.cancel_after_ms) setTimeout(() => call.cancel(), c.cancel_after_ms);
    else call.end();
  });
}

function watch(c) {  // the first status the server sends, then the client cancels the watch
  return new Promise((resolve) => {
    const call = health.Watch({ service: "" }, deadline(c));
    let first = null;
    call.on("data", (reply) => { if (first === null) { first = b64(H.Watch.responseSerialize(reply)); call.cancel(); } });
    call.on("error", (err) => resolve({ reply: first, ...failed(err) }));
    call.on("status", (s) => { if (s.code === grpc.status.OK) resolve({ reply: first, code: 0 }); });
  });
}

async function main() {
  const cases = JSON.parse(fs.readFileSync(casesFile, "utf8"));
  for (const c of cases) {
    const t0 = process.hrtime.bigint();
    let out;
    if (c.rpc === "Embed" || c.rpc === "Info") out = await unary(tulip, c.rpc, T[c.rpc], c);
    else if (c.rpc === "Check") out = await unary(health, "Check", H.Check, c);
    else if (c.rpc === "EmbedStream") out = await stream(c);
    else if (c.rpc === "Watch") out = await watch(c);
    else if (c.rpc === "RawEmbed") out = await raw(c);
    else throw new Error(`unknown rpc ${c.rpc}`);
    const ms = Number(process.hrtime.bigint() - t0) / 1e6;
    process.stdout.write(JSON.stringify({ name: c.name, ms, ...out }) + "\n");
  }
  tulip.close();
  health.close();
}

main().catch((e) => { console.error(e); process.exit(1); });
