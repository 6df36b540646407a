# Launch one SGLang server (--skip-tokenizer-init), measure closed-loop output tok/s at several concurrencies, stop it.
# usage: bench8b.py NAME OUTDIR -- <launch_server args...>     exit 0 ok, 2 server not ready, 3 bench error
# env: CONC=1,16,64,128  T_LEVEL=10 (s of issuing per level)  ISL=512  OSL=256  READY_TIMEOUT=360
#      PROFILE_CONC=64: during that level, SGLang's own /start_profile records PROFILE_STEPS forward steps
#      (torch profiler, CPU+GPU); gpu/llama8b/prof_summary.py reduces the trace to per-step kernel time.
# Copied from shared/gpu-sglang/llama8b-shape/bench8b.py (the recipe's client); the profile trigger is specgate's.
import sys, os, json, time, subprocess, signal, asyncio, re, random, statistics
import aiohttp, requests
name, outdir = sys.argv[1:3]
srv_args = sys.argv[sys.argv.index('--') + 1:]
os.makedirs(outdir, exist_ok=True)
PORT = 30000; URL = f'http://127.0.0.1:{PORT}'
CONC = [int(x) for x in os.environ.get('CONC', '1,16,64,128').split(',')]
T_LEVEL = float(os.environ.get('T_LEVEL', 10)); ISL = int(os.environ.get('ISL', 512)); OSL = int(os.environ.get('OSL', 256))
READY_TIMEOUT = int(os.environ.get('READY_TIMEOUT', 330))
rng = random.Random(1234)
def rand_ids(): return [rng.randrange(1000, 128000) for _ in range(ISL)]
res = {'name': name, 'args': srv_args, 'env': {k: v for k, v in os.environ.items() if k.startswith('SGLANG_')},
       'T_LEVEL': T_LEVEL, 'ISL': ISL, 'OSL': OSL}
logpath = os.path.join(outdir, f'{name}.server.log')
def log(*a): print(f'[{name} {time.strftime("%H:%M:%S")}]', *a, flush=True)
def dump(): json.dump(res, open(os.path.join(outdir, f'{name}.json'), 'w'), indent=1)
logf = open(logpath, 'w')
cmd = [sys.executable, '-m', 'sglang.launch_server', '--port', str(PORT), '--host', '127.0.0.1'] + srv_args
log('launch:', ' '.join(cmd))
t0 = time.time()
p = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
open(os.path.join(outdir, 'server.pid'), 'w').write(str(p.pid))
ok = False
while time.time() - t0 < READY_TIMEOUT:
    if p.poll() is not None: break
    try:
        if requests.get(URL + '/health_generate', timeout=5).status_code == 200: ok = True; break
    except Exception: pass
    time.sleep(1)
res['startup_s'] = round(time.time() - t0, 1); res['ready'] = ok
def logtext(): return open(logpath, errors='replace').read()
res['startup_lines'] = [l[:300] for l in logtext().splitlines()
                        if re.search(r'elapsed=|Load weight end|KV Cache is alloc|AdaptiveSpeculativeParams|max_total_num_tokens|Uvicorn running', l)]
log('ready' if ok else 'NOT READY', res['startup_s'], 's')
def stop():
    try: os.killpg(p.pid, signal.SIGTERM)
    except Exception: pass
    try: p.wait(30)
    except Exception:
        try: os.killpg(p.pid, signal.SIGKILL)
        except Exception: pass
        try: p.wait(15)
        except Exception: pass
    time.sleep(3)
if not ok:
    stop(); logf.close(); txt = logtext()
    res['error_tail'] = txt[-5000:]; dump()
    print('\n'.join([l for l in txt.splitlines() if 'Ignore import error' not in l][-40:])[-5000:]); sys.exit(2)

async def post(sess, osl):
    ts = time.perf_counter()
    async with sess.post(URL + '/generate', json={'input_ids': rand_ids(), 'sampling_params': {
            'max_new_tokens': osl, 'temperature': 0, 'ignore_eos': True}}) as r:
        j = await r.json()
    m = j['meta_info']
    return ts, time.perf_counter(), m['completion_tokens'], m.get('spec_verify_ct') or 0
async def closed_loop(conc, T, osl, nmax=None):
    recs = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=900)) as sess:
        t0 = time.perf_counter(); dl = t0 + T; issued = [0]
        async def worker():
            while time.perf_counter() < dl and (nmax is None or issued[0] < nmax):
                issued[0] += 1
                recs.append(await post(sess, osl))
        await asyncio.gather(*[worker() for _ in range(conc)])
    wall = max(r[1] for r in recs) - t0; toks = sum(r[2] for r in recs); ver = sum(r[3] for r in recs)
    return {'conc': conc, 'n': len(recs), 'wall_s': round(wall, 2), 'out_tokens': toks, 'out_tok_per_s': round(toks / wall, 1),
            'mean_latency_s': round(sum(r[1] - r[0] for r in recs) / len(recs), 3),
            'tokens_per_verify': round(toks / ver, 3) if ver else None}
def parse_segment(seg, conc):
    g, acc = [], []
    for l in seg.splitlines():
        m = re.search(r'Decode batch, #running-req: (\d+).*?gen throughput \(token/s\): ([\d.]+)', l)
        if m and int(m.group(1)) == conc:
            g.append(float(m.group(2)))
            a = re.search(r'accept len: ([\d.]+)', l)
            if a: acc.append(float(a.group(1)))
    return {'log_decode_lines': len(g), 'log_gen_tput_median': round(statistics.median(g), 1) if g else None,
            'log_accept_len_median': statistics.median(acc) if acc else None,
            'adaptive_switches': len(re.findall(r'Switch adaptive runtime state', seg)),
            'switch_lines': re.findall(r'Switch adaptive runtime state: steps \d+ -> \d+', seg)[:6]}
try:
    r = requests.post(URL + '/generate', json={'input_ids': rand_ids(), 'sampling_params': {'max_new_tokens': 16, 'temperature': 0, 'ignore_eos': True}}, timeout=120).json()
    res['smoke'] = {'output_ids': r.get('output_ids'), 'meta': {k: r['meta_info'].get(k) for k in ('prompt_tokens', 'completion_tokens', 'spec_verify_ct', 'spec_accept_length')}}
    log('smoke', json.dumps(res['smoke'])[:600])
    tw = time.time()
    asyncio.run(closed_loop(max(CONC), 120, 32, nmax=max(CONC)))   # warm-up: one wave of max conc, 32 tokens
    asyncio.run(closed_loop(1, 120, 32, nmax=2))
    res['warmup_s'] = round(time.time() - tw, 1); log('warm-up', res['warmup_s'], 's')
    res['bench'] = []
    PROFILE_CONC = int(os.environ.get('PROFILE_CONC', 0)); PROFILE_STEPS = int(os.environ.get('PROFILE_STEPS', 20))
    def profile_later(prof_dir):
        time.sleep(min(4.0, T_LEVEL / 2))
        try:
            r = requests.post(URL + '/start_profile', json={'output_dir': prof_dir, 'num_steps': PROFILE_STEPS,
                              'activities': ['CPU', 'GPU'], 'profile_prefix': name}, timeout=120)
            log('profile', r.status_code, r.text[:200])
        except Exception as e: log('profile failed', e)
    for c in CONC:
        off = os.path.getsize(logpath)
        if c == PROFILE_CONC:
            import threading
            prof_dir = os.path.join(outdir, f'prof_{name}'); os.makedirs(prof_dir, exist_ok=True)
            threading.Thread(target=profile_later, args=(prof_dir,), daemon=True).start()
        b = asyncio.run(asyncio.wait_for(closed_loop(c, T_LEVEL, OSL), T_LEVEL + 150))
        time.sleep(0.5)
        with open(logpath, errors='replace') as f: f.seek(off); seg = f.read()
        b.update(parse_segment(seg, c)); res['bench'].append(b); log('bench', json.dumps(b)); dump()
    si = requests.get(URL + '/server_info', timeout=30).json()
    ist = si.get('internal_states', [{}])
    res['server_info'] = {k: si.get(k) for k in ('version', 'speculative_algorithm', 'speculative_adaptive', 'speculative_num_steps',
                          'speculative_num_draft_tokens', 'speculative_eagle_topk', 'attention_backend', 'sampling_backend',
                          'max_running_requests', 'cuda_graph_max_bs', 'cuda_graph_max_bs_decode', 'cuda_graph_bs_decode',
                          'chunked_prefill_size', 'load_format', 'speculative_draft_load_format', 'mem_fraction_static', 'context_length')}
    res['server_info']['avg_spec_accept_length'] = [x.get('avg_spec_accept_length') for x in ist]
    res['server_info']['max_total_num_tokens'] = [x.get('max_total_num_tokens') for x in ist]
    log('server_info', json.dumps(res['server_info']))
    rc = 0
except Exception:
    import traceback; res['error'] = traceback.format_exc(); log('ERROR', res['error']); rc = 3
finally:
    stop(); logf.close(); dump()
    txt = logtext()
    keys = [l[:300] for l in txt.splitlines() if re.search(r'Traceback|Error|error|Switch adaptive|AdaptiveSpec|Built adaptive', l) and 'Ignore import error' not in l]
    log('log lines of interest:\n' + '\n'.join(keys[-25:]))
sys.exit(rc)
