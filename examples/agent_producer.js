// An agent harness in Node.js, built from proto/ at run time: multi-turn chained-addition
// episodes through rollwire's sessions, scored and submitted to the learner's LearnerService.
// The same environment as examples/agent_producer.py (rollwire.learner.chain): the model
// answers `12+30=`, the environment turns its answer into the next question (`|42+05=`) for
// three turns; an episode succeeds when every turn is right, its reward is the share of right
// turns. Each episode is one session (GenerateRequest.session): every turn sends only its new
// text, and GenerationStarted.prompt_token_ids returns the whole history the model saw, so the
// environment's tokens are known as exact ids without a tokenizer here. The n episodes of one
// chain form one GRPO group; each is submitted with a loss mask false on every environment
// token, the replica's logprobs and versions, and its reward (docs/sessions.md, "The
// ingestion contract"). A group pushed back (RESOURCE_EXHAUSTED) is sent again after the hint.
//
// Usage: node examples/agent_producer.js --target HOST:PORT --learner HOST:PORT
//          [--groups 4] [--n 4] [--seed 0] [--token-file FILE] [--dump FILE.jsonl]
// Needs @grpc/grpc-js and @grpc/proto-loader (`npm ci --prefix .tools`). Prints one JSON line of
// counts; exit code 1 when a trajectory was refused for any reason but staleness.
'use strict';
const crypto = require('crypto');
const fs = require('fs');
const path = require('path');
const { createRequire } = require('module');

const root = path.join(__dirname, '..');
const toolsRequire = createRequire(path.join(root, '.tools', 'package.json'));
const grpc = toolsRequire('@grpc/grpc-js');
const protoLoader = toolsRequire('@grpc/proto-loader');

const TURNS = 3;
const MAX_ADDEND = 49;
const MAX_TOTAL = 99;
const BUSY = grpc.status.RESOURCE_EXHAUSTED;

function parseArgs(argv) {
  const args = { groups: 4, n: 4, seed: 0, heldOutFraction: 0.1, tokenFile: '', dump: '', maxNewTokens: 4 };
  const names = { '--target': 'target', '--learner': 'learner', '--groups': 'groups', '--n': 'n', '--seed': 'seed',
    '--token-file': 'tokenFile', '--dump': 'dump', '--held-out-fraction': 'heldOutFraction' };
  for (let i = 0; i < argv.length; i += 2) {
    const key = names[argv[i]];
    if (!key || argv[i + 1] === undefined) throw new Error(`unknown or incomplete argument ${argv[i]}`);
    args[key] = typeof args[key] === 'number' ? Number(argv[i + 1]) : argv[i + 1];
  }
  if (!args.target || !args.learner) throw new Error('--target and --learner are required');
  return args;
}

// -- the environment (rollwire.learner.chain, in JavaScript) ---------------------------------
function pad(value, width) { return String(value).padStart(width, '0'); }

function random(seed) { // mulberry32: a small seeded generator, enough to draw chains
  let state = seed >>> 0;
  return () => {
    state = (state + 0x6d2b79f5) >>> 0;
    let t = state;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

function isHeldOut(text, fraction) { // the learner's split: the first 4 bytes of sha256(text)
  return crypto.createHash('sha256').update(text).digest().readUInt32BE(0) < fraction * 2 ** 32;
}

function drawChain(next, fraction) {
  for (;;) {
    const numbers = Array.from({ length: TURNS + 1 }, () => Math.floor(next() * (MAX_ADDEND + 1)));
    if (numbers.reduce((a, b) => a + b, 0) > MAX_TOTAL) continue;
    const [a, b, ...addends] = numbers;
    const prompt = `${pad(a, 2)}+${pad(b, 2)}=`;
    if (isHeldOut(prompt + addends.map((c) => pad(c, 2)).join(','), fraction)) continue;
    return { a, b, addends, prompt };
  }
}

function readAnswer(text) {
  const stripped = text.trim();
  return /^\d{3}$/.test(stripped) && Number(stripped) <= MAX_TOTAL ? Number(stripped) : null;
}

// -- one session turn ------------------------------------------------------------------------
function turn(generator, request, metadata) {
  return new Promise((resolve, reject) => {
    const reply = { prompt: null, tokens: [], logprobs: [], versions: [], text: '' };
    const call = generator.Generate(request, metadata, { deadline: new Date(Date.now() + 60000) });
    call.on('data', (message) => {
      if (message.restarted) Object.assign(reply, { tokens: [], logprobs: [], versions: [], text: '' });
      if (message.started) reply.prompt = message.started.prompt_token_ids;
      for (const chunk of message.tokens) {
        reply.tokens.push(...chunk.token_ids);
        reply.logprobs.push(...chunk.logprobs);
        reply.versions.push(...chunk.token_ids.map(() => chunk.adapter_version));
        reply.text += chunk.text;
      }
    });
    call.on('status', (status) => (status.code === grpc.status.OK ? resolve(reply)
      : reject(Object.assign(new Error(status.details), { code: status.code }))));
    call.on('error', () => {}); // reported through 'status'
  });
}

async function playEpisode(generator, metadata, chain, adapter, sessionId, args) {
  const history = [];
  const episode = { prompt: null, token_ids: [], loss_mask: [], logprobs: [], token_versions: [], right: 0 };
  let [left, right, text] = [chain.a, chain.b, chain.prompt];
  for (let t = 0; t < TURNS; t += 1) {
    const end = t === TURNS - 1;
    const request = { text, n: 1, adapter, sampling: { max_new_tokens: args.maxNewTokens, temperature: 1.0 },
      session: { id: sessionId, end, expect_tokens: history.length } };
    const reply = await turn(generator, request, metadata);
    if (reply.prompt.slice(0, history.length).some((id, i) => id !== history[i])) {
      throw new Error(`session ${sessionId}: the server's history is not the episode's`);
    }
    const fresh = reply.prompt.slice(history.length); // this turn's new tokens, as the model saw them
    if (t === 0) {
      episode.prompt = fresh;
    } else { // the environment's tokens: never trained
      episode.token_ids.push(...fresh);
      episode.loss_mask.push(...fresh.map(() => false));
      episode.logprobs.push(...fresh.map(() => 0));
      episode.token_versions.push(...fresh.map(() => 0));
    }
    episode.token_ids.push(...reply.tokens);
    episode.loss_mask.push(...reply.tokens.map(() => true));
    episode.logprobs.push(...reply.logprobs);
    episode.token_versions.push(...reply.versions);
    history.push(...fresh, ...reply.tokens);
    const answer = readAnswer(reply.text);
    if (answer === left + right) episode.right += 1;
    if (answer === null || end) break;
    [left, right] = [answer, chain.addends[t]];
    text = `|${pad(left, 2)}+${pad(right, 2)}=`;
  }
  return episode;
}

// -- submitting ------------------------------------------------------------------------------
function submitOnce(learner, trajectories, metadata) {
  return new Promise((resolve, reject) => {
    const statuses = [];
    const call = learner.SubmitTrajectories(metadata, { deadline: new Date(Date.now() + 60000) });
    call.on('data', (response) => statuses.push(response.status));
    call.on('status', (status) => (status.code === grpc.status.OK ? resolve(statuses)
      : reject(Object.assign(new Error(status.details), { code: status.code }))));
    call.on('error', () => {});
    for (const trajectory of trajectories) call.write({ trajectory });
    call.end();
  });
}

async function submit(learner, trajectories, metadata) {
  const final = new Array(trajectories.length);
  let waiting = trajectories.map((_, i) => i);
  for (let attempt = 0; waiting.length && attempt < 60; attempt += 1) {
    const statuses = await submitOnce(learner, waiting.map((i) => trajectories[i]), metadata);
    waiting.forEach((i, k) => { final[i] = statuses[k]; });
    const busy = waiting.filter((i) => final[i].code === BUSY);
    if (!busy.length) break;
    await new Promise((r) => setTimeout(r, Math.max(...busy.map((i) => final[i].retry_after_ms))));
    waiting = busy;
  }
  return final;
}

function load(file) {
  const options = { includeDirs: [path.join(root, 'proto')], keepCase: true, longs: Number, enums: String,
    defaults: true, oneofs: true };
  return grpc.loadPackageDefinition(protoLoader.loadSync(file, options)).rollwire.v1;
}

async function main() {
  const args = parseArgs(process.argv.slice(2));
  const metadata = new grpc.Metadata();
  if (args.tokenFile) metadata.add('authorization', `Bearer ${fs.readFileSync(args.tokenFile, 'utf8').trim()}`);
  const credentials = grpc.credentials.createInsecure();
  const generator = new (load('rollwire/v1/generator.proto').GeneratorService)(args.target, credentials);
  const learner = new (load('rollwire/v1/learner.proto').LearnerService)(args.learner, credentials);
  const status = await new Promise((resolve, reject) => learner.GetIngestStatus({}, metadata,
    { deadline: new Date(Date.now() + 30000) }, (err, reply) => (err ? reject(err) : resolve(reply))));
  const adapter = { name: status.adapter_name, version: 0 }; // version 0: the newest
  const next = random(args.seed);
  const counts = { groups: 0, episodes: 0, successes: 0, trajectories: {} };
  const dump = args.dump ? fs.openSync(args.dump, 'w') : null;
  for (let g = 0; g < args.groups; g += 1) {
    const chain = drawChain(next, args.heldOutFraction);
    const groupId = `node-${args.seed}-${g}-${crypto.randomUUID()}`;
    const episodes = await Promise.all(Array.from({ length: args.n },
      (_, i) => playEpisode(generator, metadata, chain, adapter, `${groupId}-${i}`, args)));
    const trajectories = episodes.map((e, i) => ({
      group_id: groupId, group_size: args.n, prompt_token_ids: e.prompt, token_ids: e.token_ids,
      loss_mask: e.loss_mask, logprobs: e.logprobs, token_versions: e.token_versions,
      reward: e.right / TURNS, correct: e.right === TURNS, trajectory_id: `${groupId}/${i}`,
    }));
    const statuses = await submit(learner, trajectories, metadata);
    counts.groups += 1;
    counts.episodes += episodes.length;
    counts.successes += episodes.filter((e) => e.right === TURNS).length;
    statuses.forEach((s, i) => {
      const outcome = s.code === 0 ? 'accepted' : s.reason;
      counts.trajectories[outcome] = (counts.trajectories[outcome] || 0) + 1;
      if (dump !== null) fs.writeSync(dump, `${JSON.stringify({ chain, trajectory: trajectories[i], status: s })}\n`);
    });
  }
  if (dump !== null) fs.closeSync(dump);
  generator.close();
  learner.close();
  console.log(JSON.stringify(counts));
  const refused = Object.entries(counts.trajectories).filter(([k]) => !['accepted', 'STALE_TRAJECTORY'].includes(k));
  process.exitCode = refused.length ? 1 : 0;
}

main().catch((err) => {
  console.log(JSON.stringify({ error: { code: err.code, details: err.message } }));
  process.exitCode = 1;
});
