// grpc-js against a poolserve tree (reliability/interop.py runs it; it prints
// one JSON line of what each call got). Usage: node interop_client.js ADDRESS PROTO_DIR
"use strict";

const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const [address, protoDir] = process.argv.slice(2);
const definition = protoLoader.loadSync("inference.proto", {
  includeDirs: [protoDir],
  keepCase: true,
  longs: String,
  defaults: true,
});
const inference = grpc.loadPackageDefinition(definition).inference;
const client = new inference.GRPCInferenceService(address, grpc.credentials.createInsecure());
const deadline = () => new Date(Date.now() + 30000);

function unary(method, request) {
  return new Promise((resolve) => {
    client[method](request, { deadline: deadline() }, (error, reply) => {
      resolve(error ? { code: error.code, details: error.details } : { code: 0, reply });
    });
  });
}

function tensor(values) {
  const raw = Buffer.alloc(4 * values.length);
  values.forEach((value, i) => raw.writeFloatLE(value, 4 * i));
  return {
    model_name: "echo",
    inputs: [{ name: "INPUT0", datatype: "FP32", shape: [1, values.length] }],
    raw_input_contents: [raw],
  };
}

function floats(reply) {
  const raw = reply.raw_output_contents[0];
  const out = [];
  for (let at = 0; at < raw.length; at += 4) out.push(raw.readFloatLE(at));
  return out;
}

function stream(requests) {
  return new Promise((resolve) => {
    const call = client.ModelStreamInfer({ deadline: deadline() });
    const replies = [];
    call.on("data", (reply) => {
      replies.push(reply.error_message ? { error: reply.error_message } : floats(reply.infer_response));
    });
    call.on("error", (error) => resolve({ code: error.code, details: error.details, replies }));
    call.on("end", () => resolve({ code: 0, replies }));
    requests.forEach((request) => call.write(request));
    call.end();
  });
}

async function main() {
  const out = {};
  out.live = await unary("ServerLive", {});
  out.ready = await unary("ServerReady", {});
  const infer = await unary("ModelInfer", tensor([1, 2, 3]));
  out.infer = infer.code === 0 ? { code: 0, values: floats(infer.reply) } : infer;
  out.error = await unary("ModelInfer", { ...tensor([1]), model_name: "no_such_model" });
  out.stream = await stream([tensor([1]), tensor([2, 3]), tensor([4, 5, 6])]);
  process.stdout.write(JSON.stringify(out) + "\n");
  client.close();
}

main().catch((error) => {
  process.stderr.write(String(error && error.stack) + "\n");
  process.exit(1);
});
