//! The launch files under `deploy/` (issue 53), checked offline:
//! - the Slurm scripts pass `bash -n` and shellcheck;
//! - `kubectl kustomize` renders the base and every overlay (the static-secret ones
//!   with certificates `make-certs.sh` makes with the real `yatt-node cert`);
//! - `kubernetes-validate --strict` passes on the core kinds (cert-manager's kinds have
//!   no schema there; their meaning is checked below);
//! - the rendered manifests mean what docs/launch.md says: the seed is
//!   `<statefulset>-0.<service>` (asked of `yatt-node plan` under the pod's
//!   environment), pod 0's peers are the other pods of `spec.replicas`, probes
//!   hit /health on the HTTP port, GPU limits, a memory-backed
//!   /dev/shm, Secrets mounted read-only at --certs, and each certificate's organization
//!   one of yatt's three kinds.
//!
//! A missing tool fails the test with how to install it: `source scripts/bootstrap.sh`
//! puts shellcheck and kubernetes-validate into .venv (kubectl comes from the machine).

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;
use yatt_integration_tests::yatt_node_bin;

const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/..");

/// A tool from `.venv/bin` or PATH; fails naming how to get it.
fn tool(name: &str) -> PathBuf {
    let venv = Path::new(ROOT).join(".venv/bin").join(name);
    if venv.is_file() {
        return venv;
    }
    let on_path = std::env::var_os("PATH").and_then(|p| {
        std::env::split_paths(&p)
            .map(|d| d.join(name))
            .find(|p| p.is_file())
    });
    on_path.unwrap_or_else(|| {
        panic!("{name} is missing: `source scripts/bootstrap.sh` installs it (into .venv/bin), or install it yourself")
    })
}

fn run(cmd: &mut Command) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("running {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn the_slurm_scripts_pass_bash_n_and_shellcheck() {
    let shellcheck = tool("shellcheck");
    for script in [
        "deploy/slurm/yatt.sbatch",
        "deploy/k8s/overlays/static-secret/make-certs.sh",
    ] {
        let path = Path::new(ROOT).join(script);
        run(Command::new("bash").arg("-n").arg(&path));
        run(Command::new(&shellcheck).arg(&path));
    }
}

/// Renders `deploy/k8s/<dir>` from a copy of `deploy/k8s` with certificates made, as
/// JSON documents.
fn render(copy: &Path, dir: &str) -> Vec<Value> {
    let yaml = run(Command::new(tool("kubectl"))
        .arg("kustomize")
        .arg(copy.join(dir)));
    let python = Path::new(ROOT).join(".venv/bin/python");
    assert!(
        python.is_file(),
        "{} is missing: run `source scripts/bootstrap.sh`",
        python.display()
    );
    let mut child = Command::new(python)
        .args(["-c", "import json, sys, yaml; print(json.dumps([d for d in yaml.safe_load_all(sys.stdin) if d]))"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write as _;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(yaml.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "PyYAML could not read the rendering of {dir}"
    );
    let docs: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap();
    // kubernetes-validate on the core kinds, in a file of their own.
    let core: Vec<&Value> = docs
        .iter()
        .filter(|d| {
            !d["apiVersion"]
                .as_str()
                .unwrap_or("")
                .contains("cert-manager.io")
        })
        .collect();
    let file = copy.join(format!("{}.json", dir.replace('/', "-")));
    let text: String = core.iter().map(|d| format!("{d}\n---\n")).collect();
    std::fs::write(&file, text).unwrap();
    let validate = run(Command::new(tool("kubernetes-validate"))
        .args(["--strict", "--quiet"])
        .arg(&file));
    assert!(!validate.contains("ERROR"), "{dir}: {validate}");
    docs
}

fn one<'a>(docs: &'a [Value], kind: &str) -> &'a Value {
    let mut it = docs.iter().filter(|d| d["kind"] == kind);
    let d = it.next().unwrap_or_else(|| panic!("no {kind}"));
    assert!(it.next().is_none(), "more than one {kind}");
    d
}

fn env_of(container: &Value, config_map: &Value) -> Vec<(String, String)> {
    let mut env: Vec<(String, String)> = config_map["data"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.as_str().unwrap().to_string()))
        .collect();
    for e in container["env"].as_array().into_iter().flatten() {
        if let Some(v) = e["value"].as_str() {
            env.push((e["name"].as_str().unwrap().into(), v.into()));
        }
    }
    env
}

/// Checks what every rendering must mean; returns the names of the Secrets mounted.
fn check_meaning(dir: &str, docs: &[Value]) {
    let sts = one(docs, "StatefulSet");
    let svc = one(docs, "Service");
    let job = one(docs, "Job");
    let launch = docs
        .iter()
        .find(|d| d["kind"] == "ConfigMap" && d["metadata"]["name"] == "yatt-launch")
        .expect("the yatt-launch ConfigMap");
    let (set, service) = (
        sts["metadata"]["name"].as_str().unwrap(),
        svc["metadata"]["name"].as_str().unwrap(),
    );
    assert_eq!(sts["spec"]["serviceName"], service, "{dir}");
    assert_eq!(
        svc["spec"]["clusterIP"], "None",
        "{dir}: the Service must be headless"
    );
    assert_eq!(svc["spec"]["publishNotReadyAddresses"], true, "{dir}");
    assert_eq!(sts["spec"]["podManagementPolicy"], "Parallel", "{dir}");
    let pod = &sts["spec"]["template"]["spec"];
    let c = &pod["containers"][0];
    let env = env_of(c, launch);
    let var = |k: &str| {
        env.iter()
            .rev()
            .find(|(n, _)| n == k)
            .map(|(_, v)| v.clone())
    };
    let args: Vec<&str> = c["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    assert!(
        args.windows(2).any(|w| w == ["--launcher", "k8s"]),
        "{dir}: {args:?}"
    );
    let pod_name = c["env"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "POD_NAME");
    assert_eq!(
        pod_name.map(|e| &e["valueFrom"]["fieldRef"]["fieldPath"]),
        Some(&Value::from("metadata.name"))
    );

    // The seed, as the node resolves it under pod 1's environment.
    let port = var("YATT_PORT").expect("YATT_PORT");
    let mut plan_env: Vec<(String, String)> = env.clone();
    plan_env.push(("POD_NAME".into(), format!("{set}-1")));
    plan_env.push(("POD_IP".into(), "10.0.0.9".into()));
    let certs_flag = args
        .windows(2)
        .find(|w| w[0] == "--certs")
        .map(|w| w[1])
        .expect("--certs");
    let plan = run(Command::new(yatt_node_bin())
        .args(["plan", "--launcher", "k8s", "--certs", certs_flag])
        .env_clear()
        .envs(plan_env.iter().map(|(k, v)| (k.as_str(), v.as_str()))));
    let plan: Value = serde_json::from_str(&plan).unwrap();
    assert_eq!(
        plan["seed"],
        format!("{set}-0.{service}:{port}"),
        "{dir}: {plan:#}"
    );
    assert_eq!(plan["name"], format!("{set}-1"));
    // Pod 0's peers: every other pod of the StatefulSet's size, which YATT_REPLICAS
    // sets; a restarted pod 0 asks them for the live cluster before it leads.
    let replicas = sts["spec"]["replicas"].as_u64().expect("spec.replicas");
    assert_eq!(
        var("YATT_REPLICAS"),
        Some(replicas.to_string()),
        "{dir}: YATT_REPLICAS must be the StatefulSet's size"
    );
    let mut zero_env = env.clone();
    zero_env.push(("POD_NAME".into(), format!("{set}-0")));
    let zero = run(Command::new(yatt_node_bin())
        .args(["plan", "--launcher", "k8s", "--certs", certs_flag])
        .env_clear()
        .envs(zero_env.iter().map(|(k, v)| (k.as_str(), v.as_str()))));
    let zero: Value = serde_json::from_str(&zero).unwrap();
    let peers: Vec<String> = (1..replicas)
        .map(|k| format!("{set}-{k}.{service}:{port}"))
        .collect();
    assert_eq!(
        (zero["leader"].as_bool(), &zero["peers"]),
        (Some(true), &serde_json::json!(peers)),
        "{dir}: {zero:#}"
    );
    let job_args: Vec<&str> = job["spec"]["template"]["spec"]["containers"][0]["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    assert!(
        job_args
            .windows(2)
            .any(|w| w[0] == "--cluster" && w[1] == format!("{set}-0.{service}:{port}")),
        "{dir}: the Job must join through pod 0: {job_args:?}"
    );

    // Probes: /health on the container port named in them, which is YATT_HTTP_PORT.
    let http_port: u64 = var("YATT_HTTP_PORT").unwrap().parse().unwrap();
    for probe in ["startupProbe", "readinessProbe", "livenessProbe"] {
        let get = &c[probe]["httpGet"];
        assert_eq!(get["path"], "/health", "{dir}: {probe}");
        let port = match &get["port"] {
            Value::String(name) => c["ports"]
                .as_array()
                .unwrap()
                .iter()
                .find(|p| &p["name"] == name)
                .map(|p| p["containerPort"].as_u64().unwrap()),
            n => n.as_u64(),
        };
        assert_eq!(
            port,
            Some(http_port),
            "{dir}: {probe} must hit the HTTP port"
        );
    }
    assert!(
        c["lifecycle"]["preStop"]["exec"]["command"].is_array(),
        "{dir}: preStop"
    );
    let drain_ms: u64 = var("YATT_NODE__TRANSPORT__DRAIN_TIMEOUT_MS")
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        pod["terminationGracePeriodSeconds"].as_u64().unwrap() * 1000 > drain_ms,
        "{dir}"
    );

    // GPUs, /dev/shm.
    let gpus = &c["resources"]["limits"]["nvidia.com/gpu"];
    assert_eq!(
        gpus.as_str()
            .map(str::to_string)
            .or(gpus.as_u64().map(|n| n.to_string())),
        var("YATT_GPUS_PER_NODE"),
        "{dir}: GPU limit"
    );
    let volumes = pod["volumes"].as_array().unwrap();
    let shm_mount = c["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["mountPath"] == "/dev/shm")
        .expect("/dev/shm mount");
    let shm = volumes
        .iter()
        .find(|v| v["name"] == shm_mount["name"])
        .unwrap();
    assert_eq!(
        shm["emptyDir"]["medium"], "Memory",
        "{dir}: /dev/shm must be memory-backed"
    );
    assert_eq!(
        shm["emptyDir"]["sizeLimit"].as_str().map(str::to_string),
        var("SHM_SIZE"),
        "{dir}"
    );

    // Secrets read-only, the certificates at --certs (node and Job).
    for (what, spec, certs) in [
        ("StatefulSet", pod, certs_flag.to_string()),
        (
            "Job",
            &job["spec"]["template"]["spec"],
            job_args
                .windows(2)
                .find(|w| w[0] == "--certs")
                .map(|w| w[1].to_string())
                .unwrap(),
        ),
    ] {
        let vols = spec["volumes"].as_array().unwrap();
        let mut at_certs = false;
        for m in spec["containers"][0]["volumeMounts"].as_array().unwrap() {
            let v = vols.iter().find(|v| v["name"] == m["name"]).unwrap();
            let secret = v.get("secret").is_some()
                || v["projected"]["sources"]
                    .as_array()
                    .is_some_and(|s| s.iter().all(|s| s.get("secret").is_some()));
            if secret {
                assert_eq!(
                    m["readOnly"], true,
                    "{dir}: {what} mounts Secret volume {} writable",
                    m["name"]
                );
            }
            at_certs |= secret && m["mountPath"] == certs.as_str();
        }
        assert!(at_certs, "{dir}: {what} has no Secret at --certs {certs}");
    }
}

/// A copy of deploy/k8s with the static-secret certificates made by `yatt-node cert`.
fn copy_with_certs() -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    run(Command::new("cp")
        .arg("-a")
        .arg(Path::new(ROOT).join("deploy/k8s"))
        .arg(tmp.path()));
    let script = tmp.path().join("k8s/overlays/static-secret/make-certs.sh");
    run(Command::new("bash")
        .arg(script)
        .arg("2")
        .env("YATT_NODE_BIN", yatt_node_bin()));
    tmp
}

#[test]
fn every_kustomize_overlay_renders_validates_and_means_what_the_docs_say() {
    let tmp = copy_with_certs();
    let k8s = tmp.path().join("k8s");
    render(&k8s, "base");
    for dir in [
        "overlays/static-secret",
        "overlays/cert-manager",
        "overlays/host-network",
    ] {
        let docs = render(&k8s, dir);
        check_meaning(dir, &docs);
        if dir.ends_with("host-network") {
            let pod = &one(&docs, "StatefulSet")["spec"]["template"]["spec"];
            assert_eq!(pod["hostNetwork"], true);
            assert_eq!(pod["dnsPolicy"], "ClusterFirstWithHostNet");
            let env = pod["containers"][0]["env"].as_array().unwrap();
            assert!(
                env.iter().any(|e| e["name"] == "NCCL_SOCKET_IFNAME"),
                "{env:?}"
            );
        }
        if dir.ends_with("static-secret") {
            let secret = one(&docs, "Secret");
            let keys: Vec<&String> = secret["data"].as_object().unwrap().keys().collect();
            for k in [
                "ca.pem",
                "yatt-node-0.pem",
                "yatt-node-1.key",
                "train.pem",
                "train.key",
            ] {
                assert!(
                    keys.iter().any(|x| *x == k),
                    "yatt-certs lacks {k}: {keys:?}"
                );
            }
            assert!(
                !keys.iter().any(|x| *x == "ca.key"),
                "the CA key must stay out of the cluster"
            );
        }
        if dir.ends_with("cert-manager") {
            check_certificates(&docs);
        }
    }
}

fn check_certificates(docs: &[Value]) {
    let kinds = ["yatt-node", "yatt-trainer", "yatt-client"];
    let sts = one(docs, "StatefulSet");
    let set = sts["metadata"]["name"].as_str().unwrap();
    let replicas = sts["spec"]["replicas"].as_u64().unwrap();
    let certs: Vec<&Value> = docs.iter().filter(|d| d["kind"] == "Certificate").collect();
    let ca_issuers: Vec<&str> = docs
        .iter()
        .filter(|d| d["kind"] == "Issuer" && d["spec"]["ca"].is_object())
        .map(|d| d["metadata"]["name"].as_str().unwrap())
        .collect();
    let mut seen_kinds = Vec::new();
    let mut node_names = Vec::new();
    for c in certs.iter().filter(|c| c["spec"]["isCA"] != true) {
        let s = &c["spec"];
        let orgs = s["subject"]["organizations"].as_array().unwrap();
        assert_eq!(orgs.len(), 1, "{c}");
        let kind = orgs[0].as_str().unwrap();
        assert!(kinds.contains(&kind), "{kind} is not one of {kinds:?}");
        seen_kinds.push(kind);
        if kind == "yatt-node" {
            node_names.push(s["commonName"].as_str().unwrap().to_string());
        }
        let usages: Vec<&str> = s["usages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|u| u.as_str().unwrap())
            .collect();
        assert!(
            usages.contains(&"server auth") && usages.contains(&"client auth"),
            "{usages:?}"
        );
        assert!(
            s["dnsNames"]
                .as_array()
                .unwrap()
                .iter()
                .any(|d| d == "yatt-node"),
            "yatt checks the server name yatt-node"
        );
        assert_eq!(
            s["privateKey"]["encoding"], "PKCS8",
            "yatt reads PKCS#8 keys"
        );
        assert!(
            ca_issuers.contains(&s["issuerRef"]["name"].as_str().unwrap()),
            "{c}"
        );
    }
    for k in kinds {
        assert!(seen_kinds.contains(&k), "no {k} certificate");
    }
    for k in 0..replicas {
        assert!(
            node_names.contains(&format!("{set}-{k}")),
            "no certificate for pod {set}-{k}: {node_names:?}"
        );
    }
}
