// A Node.js client of rollwire, built from proto/ at run time: proof that clients generated
// in other languages work. Usage: node generate.js HOST:PORT PROMPT N MAX_NEW_TOKENS
// Prints one JSON object: {started, samples: {index: {tokens, text, finish_reason}}, restarts}
// or {error: {code, details}} with exit code 1.
'use strict';
const path = require('path');
const { createRequire } = require('module');

const root = path.join(__dirname, '..', '..');
const toolsRequire = createRequire(path.join(root, '.tools', 'package.json'));
const grpc = toolsRequire('@grpc/grpc-js');
const protoLoader = toolsRequire('@grpc/proto-loader');

const [target, prompt, n, maxNewTokens] = process.argv.slice(2);
const definition = protoLoader.loadSync('rollwire/v1/generator.proto', {
  includeDirs: [path.join(root, 'proto')],
  keepCase: true,
  longs: Number,
  enums: String,
  defaults: true,
  oneofs: true,
});
const v1 = grpc.loadPackageDefinition(definition).rollwire.v1;
const client = new v1.GeneratorService(target, grpc.credentials.createInsecure());

const request = {
  text: prompt,
  n: Number(n),
  sampling: { max_new_tokens: Number(maxNewTokens), temperature: 1.0, seed: 7 },
};
const result = { started: null, samples: {}, restarts: 0 };
const call = client.Generate(request, { deadline: new Date(Date.now() + 30000) });
call.on('data', (message) => {
  // One message holds what became ready together: started, then tokens, then finishes.
  if (message.restarted) { // discard partial samples: the group starts again elsewhere
    result.restarts += 1;
    result.samples = {};
    return;
  }
  if (message.started) result.started = message.started;
  const sample = (i) => (result.samples[i] ??= { tokens: [], logprobs: [], text: '' });
  for (const t of message.tokens) {
    const s = sample(t.sample_index);
    s.tokens.push(...t.token_ids);
    s.logprobs.push(...t.logprobs);
    s.text += t.text;
  }
  for (const f of message.finished) sample(f.sample_index).finish_reason = f.finish_reason;
});
call.on('status', (status) => {
  if (status.code === grpc.status.OK) {
    console.log(JSON.stringify(result));
  } else {
    console.log(JSON.stringify({ error: { code: status.code, details: status.details } }));
    process.exitCode = 1;
  }
  client.close();
});
call.on('error', () => {}); // reported through 'status'
