use super::*;

const RECEIVER: &str = "\
enable_pd: true
transfer_channel: hccl
pd_role: receiver
pd_peer_host: 127.0.0.1
pd_peer_init_port: [7300, 7301]
pd_peer_alloc_port: [7400, 7401]
pd_buffer_size: 134217728
pd_buffer_device: npu
";

const SENDER: &str = "\
enable_pd: true
transfer_channel: hccl
pd_role: sender
pd_proxy_host: 127.0.0.1
pd_proxy_port: 8500
pd_buffer_size: 134217728
pd_buffer_device: npu
";

fn ok(yaml: &str) -> LoadedConfig {
    PdConfig::from_yaml_str(yaml, "t.yaml").unwrap_or_else(|e| panic!("{e}"))
}

/// Loads `yaml`, expects it to be invalid, and returns the problems.
fn problems(yaml: &str) -> Vec<ConfigProblem> {
    match PdConfig::from_yaml_str(yaml, "t.yaml") {
        Ok(c) => panic!("expected an error, got {:?}", c.config),
        Err(e) => {
            let text = e.to_string();
            let ps = e.problems().to_vec();
            for p in &ps {
                assert!(text.contains(&p.key), "{text}");
            }
            ps
        }
    }
}

/// Asserts that exactly the problem about `key` is reported, and that its text mentions `words`.
fn expect_problem(yaml: &str, key: &str, words: &[&str]) {
    let ps = problems(yaml);
    let p = ps
        .iter()
        .find(|p| p.key == key)
        .unwrap_or_else(|| panic!("no problem for {key}: {ps:?}"));
    let line = p.to_string();
    assert!(line.starts_with(key), "{line}");
    assert!(line.contains("fix:"), "{line}");
    for w in words {
        assert!(line.contains(w), "{line:?} lacks {w:?}");
    }
}

#[test]
fn defaults_are_the_documented_ones() {
    let c = ok(RECEIVER).config;
    assert_eq!(c.alloc_fail_backoff_ttl, Duration::from_secs_f64(2.0));
    assert_eq!(c.pull_pending_ttl, Duration::from_secs_f64(360.0));
    assert_eq!(c.backpressure_reserve_pct, 2.0);
    assert_eq!(c.chunk_size, 256);
    assert_eq!(c.tp_size, 1);
    assert_eq!(c.mode(), TransferMode::Push);
    assert_eq!(c.kv, KvLayout::default());
    assert_eq!(c.page_bytes(), 2 * 32 * 256 * 1024 * 2);
    assert!(!c.use_cpu_offload && !c.pull_mode && !c.delay_pull);
}

#[test]
fn modes_follow_the_pull_flags() {
    let eager = ok(&format!("{RECEIVER}pd_pull_mode: true\n")).config;
    assert_eq!(eager.mode(), TransferMode::PullEager);
    let delay = ok(&format!(
        "{RECEIVER}pd_pull_mode: true\npd_delay_pull: true\n"
    ))
    .config;
    assert_eq!(delay.mode(), TransferMode::PullDelay);
    assert_eq!(delay.mode().name(), "pull-delay");
}

#[test]
fn cpu_buffer_size_falls_back_to_buffer_size() {
    let page = 2 * 32 * 256 * 1024 * 2u64;
    let base = format!(
        "{SENDER}pd_pull_mode: true\npd_pull_done_port: [7600]\npd_use_cpu_offload: true\n"
    );
    let c = ok(&base).config;
    assert_eq!(c.cpu_buffer_size, None);
    assert_eq!(c.cpu_pool_bytes(), 134217728u64.div_ceil(page) * page);
    let c = ok(&format!("{base}pd_cpu_buffer_size: {}\n", 10 * page)).config;
    assert_eq!(c.cpu_pool_bytes(), 10 * page);
}

#[test]
fn done_port_falls_back_to_alloc_port_plus_100() {
    let c = ok(&format!(
        "{SENDER}pd_pull_mode: true\npd_peer_alloc_port: [7400, 7401]\ntp_size: 2\n"
    ))
    .config;
    assert_eq!(c.done_port(0), Some(7500));
    assert_eq!(c.done_port(1), Some(7501));
    assert_eq!(c.done_port(2), None);
    let c = ok(&format!(
        "{SENDER}pd_pull_mode: true\npd_pull_done_port: [7600, 7601]\npd_peer_alloc_port: 7400\n"
    ))
    .config;
    assert_eq!(c.done_port(1), Some(7601));
}

#[test]
fn port_keys_accept_an_int_or_a_list_and_a_rank_picks_its_entry() {
    let c = ok(&RECEIVER.replace("[7300, 7301]", "7300")).config;
    assert_eq!(c.peer_init_port, Some(PortList::Single(7300)));
    assert_eq!(c.init_port(0), Some(7300));
    assert_eq!(c.init_port(3), Some(7300));
    assert_eq!(c.alloc_port(1), Some(7401));
    assert_eq!(c.alloc_port(2), None);
}

#[test]
fn delay_pull_without_pull_mode_is_an_error() {
    expect_problem(
        &format!("{RECEIVER}pd_delay_pull: true\n"),
        "pd_delay_pull",
        &["pd_pull_mode: true"],
    );
}

#[test]
fn offload_on_a_receiver_is_an_error() {
    expect_problem(
        &format!("{RECEIVER}pd_pull_mode: true\npd_use_cpu_offload: true\n"),
        "pd_use_cpu_offload",
        &["receiver"],
    );
}

#[test]
fn offload_without_pull_mode_is_an_error() {
    expect_problem(
        &format!("{SENDER}pd_use_cpu_offload: true\n"),
        "pd_use_cpu_offload",
        &["pd_pull_mode"],
    );
}

#[test]
fn pull_sender_without_a_done_port_source_is_an_error() {
    expect_problem(
        &format!("{SENDER}pd_pull_mode: true\n"),
        "pd_pull_done_port",
        &["PullDoneSignal", "pd_peer_alloc_port"],
    );
}

#[test]
fn done_port_fallback_overflow_is_an_error() {
    expect_problem(
        &format!("{SENDER}pd_pull_mode: true\npd_peer_alloc_port: 65500\n"),
        "pd_peer_alloc_port",
        &["65535"],
    );
}

#[test]
fn receiver_needs_host_and_both_ports() {
    for key in ["pd_peer_host", "pd_peer_init_port", "pd_peer_alloc_port"] {
        let yaml: String = RECEIVER
            .lines()
            .filter(|l| !l.starts_with(key))
            .map(|l| format!("{l}\n"))
            .collect();
        expect_problem(&yaml, key, &["required on a receiver"]);
    }
}

#[test]
fn a_sender_needs_both_proxy_keys_or_neither() {
    // Half an address is refused, naming the missing key.
    for key in ["pd_proxy_host", "pd_proxy_port"] {
        let yaml: String = SENDER
            .lines()
            .filter(|l| !l.starts_with(key))
            .map(|l| format!("{l}\n"))
            .collect();
        expect_problem(&yaml, key, &["while the other pd_proxy_* key is set"]);
    }
    // Neither (the vLLM connector, the router flow): valid.
    let none: String = SENDER
        .lines()
        .filter(|l| !l.starts_with("pd_proxy_"))
        .map(|l| format!("{l}\n"))
        .collect();
    ok(&none);
}

#[test]
fn pd_role_both_gives_a_sender_half_and_a_receiver_half() {
    let both = "enable_pd: true\ntransfer_channel: tcp\npd_role: both\npd_peer_host: 127.0.0.1\n\
                pd_base_port: 40000\npd_pull_mode: true\npd_pull_done_port: 40100\n\
                pd_buffer_size: 1\npd_buffer_device: cpu\n";
    let halves = PdConfig::roles_from_yaml_str(both, "both.yaml").unwrap();
    let roles: Vec<Role> = halves.iter().map(|h| h.config.role).collect();
    assert_eq!(roles, vec![Role::Sender, Role::Receiver]);
    // The receiver half has no sender key to warn about; its ports and
    // the sender's do not collide on one base.
    assert!(
        halves[1]
            .warnings
            .iter()
            .all(|w| !w.contains("pd_pull_done_port")),
        "{:?}",
        halves[1].warnings
    );
    assert_eq!(halves[0].config.done_port(0), Some(40100));
    assert_eq!(halves[1].config.init_port(0), Some(40000));
    // One role per worker: the single-role loader names the way out.
    expect_problem(both, "pd_role", &["kv_both", "roles_from_yaml_str"]);
    // A single role loads as one config.
    assert_eq!(
        PdConfig::roles_from_yaml_str(SENDER, "s.yaml")
            .unwrap()
            .len(),
        1
    );
}

#[test]
fn port_list_shorter_than_tp_size_is_an_error() {
    expect_problem(
        &format!("{RECEIVER}tp_size: 4\n"),
        "pd_peer_init_port",
        &["2 port(s)", "tp_size is 4"],
    );
    let ps = problems(&format!("{RECEIVER}tp_size: 4\n"));
    assert!(ps.iter().any(|p| p.key == "pd_peer_alloc_port"));
    // A single int serves any TP size.
    ok(&format!(
        "{}tp_size: 4\n",
        RECEIVER
            .replace("[7300, 7301]", "7300")
            .replace("[7400, 7401]", "7400")
    ));
}

#[test]
fn unknown_enum_values_are_errors_listing_the_choices() {
    expect_problem(
        &RECEIVER.replace("transfer_channel: hccl", "transfer_channel: nixl"),
        "transfer_channel",
        &["\"nixl\"", "hccl, tcp, shm, hixl"],
    );
    expect_problem(
        &RECEIVER.replace("pd_buffer_device: npu", "pd_buffer_device: cuda"),
        "pd_buffer_device",
        &["\"cuda\"", "cpu, npu, npu:N"],
    );
    expect_problem(
        &RECEIVER.replace("pd_role: receiver", "pd_role: decoder"),
        "pd_role",
        &["\"decoder\"", "sender, receiver"],
    );
    expect_problem(
        &RECEIVER.replace("pd_role: receiver\n", ""),
        "pd_role",
        &["missing"],
    );
}

#[test]
fn npu_index_is_parsed() {
    let c = ok(&RECEIVER.replace("pd_buffer_device: npu", "pd_buffer_device: npu:3")).config;
    assert_eq!(c.buffer_device, BufferDevice::Npu(Some(3)));
    assert_eq!(c.buffer_device.to_string(), "npu:3");
    expect_problem(
        &RECEIVER.replace("pd_buffer_device: npu", "pd_buffer_device: npu:x"),
        "pd_buffer_device",
        &["npu:x"],
    );
}

#[test]
fn shm_with_an_npu_pool_is_an_error() {
    expect_problem(
        &RECEIVER.replace("transfer_channel: hccl", "transfer_channel: shm"),
        "pd_buffer_device",
        &["shm", "host memory"],
    );
}

#[test]
fn wrong_types_name_the_key_and_what_was_expected() {
    expect_problem(
        &RECEIVER.replace("pd_buffer_size: 134217728", "pd_buffer_size: big"),
        "pd_buffer_size",
        &["non-negative integer", "\"big\""],
    );
    expect_problem(
        &RECEIVER.replace("[7300, 7301]", "[7300, \"x\"]"),
        "pd_peer_init_port",
        &["port number"],
    );
    expect_problem(
        &RECEIVER.replace("[7300, 7301]", "[7300, 70000]"),
        "pd_peer_init_port",
        &["70000"],
    );
    expect_problem(
        &format!("{RECEIVER}pd_pull_mode: yes please\n"),
        "pd_pull_mode",
        &["true or false"],
    );
    expect_problem(
        &format!("{RECEIVER}pd_pull_pending_ttl: -1\n"),
        "pd_pull_pending_ttl",
        &["negative"],
    );
    expect_problem(
        &format!("{RECEIVER}pd_pull_backpressure_reserve_pct: 100\n"),
        "pd_pull_backpressure_reserve_pct",
        &["[0, 100)"],
    );
    expect_problem(
        &RECEIVER.replace("enable_pd: true", "enable_pd: false"),
        "enable_pd",
        &["enable_pd: true"],
    );
    expect_problem(
        &RECEIVER.replace("pd_buffer_size: 134217728\n", ""),
        "pd_buffer_size",
        &["missing"],
    );
}

#[test]
fn every_problem_is_reported_not_just_the_first() {
    let yaml = "enable_pd: true\npd_role: receiver\npd_buffer_size: 1\npd_delay_pull: true\n";
    let keys: Vec<String> = problems(yaml).into_iter().map(|p| p.key).collect();
    for k in [
        "pd_delay_pull",
        "pd_peer_host",
        "pd_peer_init_port",
        "pd_peer_alloc_port",
    ] {
        assert!(keys.iter().any(|x| x == k), "{keys:?} lacks {k}");
    }
}

#[test]
fn small_buffer_rounds_up_to_one_page_with_a_warning() {
    // The LMCache-Ascend prefiller example: 32225472 bytes < one 36-layer chunk.
    let yaml = format!(
        "{}kv_num_layers: 36\n",
        SENDER.replace("134217728", "32225472")
    );
    let loaded = ok(&yaml);
    let page = 2 * 36 * 256 * 1024 * 2;
    assert_eq!(loaded.config.page_bytes(), page);
    assert_eq!(loaded.config.buffer_pool_bytes(), page);
    assert!(
        loaded
            .warnings
            .iter()
            .any(|w| w.starts_with("pd_buffer_size") && w.contains("rounded up to one page")),
        "{:?}",
        loaded.warnings
    );
}

#[test]
fn unknown_keys_warn_with_a_suggestion() {
    let loaded = ok(&format!("{RECEIVER}pd_pull_mdoe: true\nremote_url: null\n"));
    let w = loaded.warnings.join("\n");
    assert!(
        w.contains("pd_pull_mdoe: unknown key, ignored (did you mean pd_pull_mode?)"),
        "{w}"
    );
    assert!(w.contains("remote_url: unknown key"), "{w}");
    assert!(!loaded.config.pull_mode);
}

#[test]
fn yaml_syntax_errors_report_line_and_column() {
    let e =
        PdConfig::from_yaml_str("enable_pd: true\npd_role: [receiver\n", "bad.yaml").unwrap_err();
    match &e {
        ConfigError::Syntax { line, column, .. } => {
            assert!(*line >= 2, "line {line}");
            assert!(*column >= 1);
        }
        other => panic!("expected a syntax error, got {other:?}"),
    }
    let text = e.to_string();
    assert!(
        text.starts_with("bad.yaml: YAML syntax error at line"),
        "{text}"
    );
}

#[test]
fn top_level_must_be_a_mapping() {
    let ps = problems("- a\n- b\n");
    assert_eq!(ps[0].key, "<top level>");
}

#[test]
fn python_style_booleans_from_lmcache_examples_parse() {
    let yaml = RECEIVER.replace("enable_pd: true", "enable_pd: True") + "local_cpu: False\n";
    let c = ok(&yaml).config;
    assert!(c.enable_pd && !c.local_cpu);
}

#[test]
fn kv_layout_keys_shape_the_page() {
    let c = ok(&format!(
        "{RECEIVER}kv_num_layers: 4\nkv_num_heads: 2\nkv_head_size: 64\nkv_dtype: float32\nchunk_size: 16\n"
    ))
    .config;
    assert_eq!(c.kv.hidden_size, 128);
    assert_eq!(c.page_bytes(), 2 * 4 * 16 * 128 * 4);
    let mla = ok(&format!(
        "{RECEIVER}use_mla: true\nkv_hidden_size: 576\nkv_num_layers: 2\nchunk_size: 8\n"
    ))
    .config;
    assert_eq!(mla.chunk_layout().full_shape(), [1, 2, 8, 576]);
    expect_problem(
        &format!("{RECEIVER}kv_dtype: complex64\n"),
        "kv_dtype",
        &["complex64", "bfloat16"],
    );
}

#[test]
fn copy_threads_out_of_range_are_named() {
    for n in ["0", "257"] {
        expect_problem(
            &format!("{RECEIVER}pd_copy_threads: {n}\n"),
            "pd_copy_threads",
            &[n, "1 to 256", "set 1 to copy on the calling thread"],
        );
    }
    let two = ok(&format!("{RECEIVER}pd_copy_threads: 2\n")).config;
    assert_eq!(two.copy_threads(), 2);
    assert!(two.to_effective_yaml().contains("pd_copy_threads: 2\n"));
    let default = ok(RECEIVER).config;
    assert!((1..=8).contains(&default.copy_threads()));
}

#[test]
fn effective_yaml_round_trips_through_the_loader() {
    let loaded = ok(&format!(
        "{SENDER}pd_pull_mode: true\npd_delay_pull: true\npd_pull_done_port: [7600, 7601]\ntp_size: 2\n"
    ));
    let text = loaded.config.to_effective_yaml();
    assert!(text.contains("# mode: pull-delay"), "{text}");
    assert!(
        text.contains("# done port per rank: [7600, 7601]"),
        "{text}"
    );
    let again = ok(&text).config;
    assert_eq!(again, loaded.config);
}

#[test]
fn an_empty_or_overlong_peer_host_is_named() {
    let with_host =
        |h: &str| RECEIVER.replace("pd_peer_host: 127.0.0.1", &format!("pd_peer_host: \"{h}\""));
    expect_problem(&with_host(""), "pd_peer_host", &["0 bytes", "IP address"]);
    let long = "h".repeat(MAX_HOST_BYTES + 1);
    expect_problem(&with_host(&long), "pd_peer_host", &["181 bytes", "255"]);
    ok(&with_host(&"h".repeat(MAX_HOST_BYTES)));
}

#[test]
fn a_huge_finite_ttl_is_refused_naming_the_key_not_a_panic_later() {
    // 1e18 s used to load and then overflow `Instant + ttl` at first use;
    // 1e300 s used to be "too large for a duration".
    for v in ["1e18", "1e300", "1000000001"] {
        let ps = problems(&format!("{SENDER}pd_pull_pending_ttl: {v}\n"));
        assert_eq!(ps.len(), 1, "{ps:?}");
        assert_eq!(ps[0].key, "pd_pull_pending_ttl");
        assert!(ps[0].to_string().contains("31-year"), "{}", ps[0]);
    }
    let c = ok(&format!("{RECEIVER}pd_alloc_fail_backoff_ttl: 1e9\n"));
    let ttl = c.config.alloc_fail_backoff_ttl;
    assert_eq!(ttl, Duration::from_secs(1_000_000_000));
    // The longest accepted TTL is a valid deadline.
    assert!(std::time::Instant::now().checked_add(ttl).is_some());
}

#[test]
fn peer_tp_size_splits_heads_and_refuses_what_cannot_split() {
    let c = ok(&format!(
        "{RECEIVER}tp_size: 1\npd_peer_tp_size: 2\nkv_num_heads: 4\nkv_head_size: 128\n"
    ))
    .config;
    let plan = c.tp_plan().unwrap();
    assert_eq!(
        (plan.prefill_tp, plan.decode_tp, plan.total_heads),
        (2, 1, 4)
    );
    assert_eq!(c.head_elements(), 128);
    // The default is the same size as this side.
    let c = ok(&format!("{RECEIVER}tp_size: 2\n")).config;
    assert_eq!(c.peer_tp(), 2);
    assert!(!c.tp_plan().unwrap().is_heterogeneous());
    expect_problem(
        &format!("{RECEIVER}pd_peer_tp_size: 3\ntp_size: 2\n"),
        "pd_peer_tp_size",
        &["one must be a multiple of the other"],
    );
    // A decode rank of TP 4 fed by a prefill of TP 1 needs 4 heads to split.
    expect_problem(
        &format!("{SENDER}pd_peer_tp_size: 16\nkv_num_heads: 8\n"),
        "pd_peer_tp_size",
        &["8 KV heads do not split evenly over TP 16"],
    );
    expect_problem(
        &format!("{SENDER}pd_peer_tp_size: 2\nkv_num_heads: 8\nkv_hidden_size: 1000\n"),
        "kv_hidden_size",
        &["heads cannot be split"],
    );
    // MLA's latent is replicated: any divisible sizes work.
    let c = ok(&format!("{SENDER}pd_peer_tp_size: 4\nuse_mla: true\n")).config;
    assert!(c.tp_plan().unwrap().replicated);
}

#[test]
fn the_hccl_path_and_the_hixl_endpoint_keys_are_read_checked_and_printed() {
    let c = ok(RECEIVER).config;
    assert_eq!(c.hccl_path, HcclPath::Auto);
    assert_eq!(c.hixl, HixlSettings::default());
    let c = ok(&format!(
        "{RECEIVER}pd_hccl_path: comm\npd_hixl_protocol: hccs\npd_hixl_device_ip: \"192.168.1.8\"\n\
         pd_hixl_port: 26000\npd_hixl_device_phy_id: 4\n"
    ));
    assert!(c.warnings.is_empty(), "{:?}", c.warnings);
    let c = c.config;
    assert_eq!(c.hccl_path, HcclPath::Comm);
    assert_eq!(
        c.hixl,
        HixlSettings {
            protocol: HixlProtocol::Hccs,
            device_ip: Some("192.168.1.8".parse().unwrap()),
            port: 26000,
            device_phy_id: Some(4),
        }
    );
    // The effective YAML prints them, and reads back the same.
    let again = ok(&c.to_effective_yaml()).config;
    assert_eq!((again.hccl_path, again.hixl), (c.hccl_path, c.hixl));
    let hixl = ok(&RECEIVER.replace("transfer_channel: hccl", "transfer_channel: hixl")).config;
    assert_eq!(hixl.transfer_channel, ChannelKind::Hixl);
    expect_problem(
        &format!("{RECEIVER}pd_hccl_path: hixl-cs\n"),
        "pd_hccl_path",
        &["\"hixl-cs\"", "auto, comm, hixl"],
    );
    expect_problem(
        &format!("{RECEIVER}pd_hixl_protocol: rdma\n"),
        "pd_hixl_protocol",
        &["\"rdma\"", "roce, hccs"],
    );
    expect_problem(
        &format!("{RECEIVER}pd_hixl_device_ip: 192.168.1\n"),
        "pd_hixl_device_ip",
        &["IPv4 address"],
    );
}

#[test]
fn hccl_path_and_hixl_keys_are_ignored_with_a_warning_on_other_channels() {
    let tcp = RECEIVER.replace("transfer_channel: hccl", "transfer_channel: tcp");
    let w = ok(&format!("{tcp}pd_hccl_path: comm\npd_hixl_port: 26000\n")).warnings;
    assert!(
        w.iter()
            .any(|w| w.starts_with("pd_hccl_path: ignored") && w.contains("tcp")),
        "{w:?}"
    );
    assert!(
        w.iter().any(|w| w.starts_with("pd_hixl_*: ignored")),
        "{w:?}"
    );
    // On hixl the endpoint keys count, pd_hccl_path does not.
    let hixl = RECEIVER.replace("transfer_channel: hccl", "transfer_channel: hixl");
    let w = ok(&format!("{hixl}pd_hccl_path: comm\npd_hixl_port: 26000\n")).warnings;
    assert_eq!(w.len(), 1, "{w:?}");
    assert!(w[0].starts_with("pd_hccl_path: ignored"), "{w:?}");
}

#[test]
fn npu_link_takes_auto_none_or_a_table_link() {
    assert_eq!(ok(RECEIVER).config.npu_link, NpuLink::Auto);
    for (v, want) in [
        ("auto", NpuLink::Auto),
        ("none", NpuLink::Off),
        ("a2-roce", NpuLink::Named("a2-roce".into())),
        ("a3-hccs", NpuLink::Named("a3-hccs".into())),
    ] {
        let c = ok(&format!("{RECEIVER}pd_npu_link: {v}\n")).config;
        assert_eq!(c.npu_link, want);
        assert_eq!(c.npu_link.name(), v);
    }
    expect_problem(
        &format!("{RECEIVER}pd_npu_link: a2-nvlink\n"),
        "pd_npu_link",
        &[
            "\"a2-nvlink\"",
            "auto, none, a2-roce, a2-hccs, a3-hccs, a3-roce",
        ],
    );
    let named = NpuLink::Named("a2-hccs".into()).resolve().unwrap();
    assert_eq!(named.map(|l| l.name()), Some("a2-hccs"));
    assert_eq!(NpuLink::Off.resolve().unwrap(), None);
}

#[test]
fn base_port_fills_every_listener_by_role_and_rank() {
    // A TP-2 decode with only a base: its handshake and request ports come
    // from it, and tcp's transfer server too.
    let recv = ok(
        "enable_pd: true\ntransfer_channel: tcp\npd_role: receiver\n\
         pd_peer_host: 10.0.0.2\npd_bind_host: 0.0.0.0\npd_base_port: 20000\ntp_size: 2\n\
         pd_buffer_size: 134217728\npd_buffer_device: cpu\n",
    )
    .config;
    assert_eq!(recv.bind_host(), "0.0.0.0");
    assert_eq!(recv.init_port(1), Some(20_020));
    assert_eq!(recv.alloc_port(0), Some(20_001));
    assert_eq!(
        recv.port_table(1),
        vec![
            (Listener::Init, 20_020),
            (Listener::Alloc, 20_021),
            (Listener::Data, 20_023)
        ]
    );
    // The prefill on the same base: its block starts at +10, so both
    // roles (a kv_both engine) fit on one host. An explicit key wins.
    let send = ok(&format!(
        "{SENDER}transfer_channel: tcp\npd_base_port: 20000\ntp_size: 2\npd_pull_mode: true\n\
         pd_register_port: [21000, 21001]\npd_buffer_device: cpu\n"
    )
    .replace("transfer_channel: hccl\n", "")
    .replace("pd_buffer_device: npu\n", ""))
    .config;
    assert_eq!(
        send.port_table(1),
        vec![
            (Listener::Done, 20_030),
            (Listener::Register, 21_001),
            (Listener::Data, 20_033)
        ]
    );
    let text = send.port_table_text();
    assert!(
        text.contains("20030") && text.contains("pd_pull_done_port"),
        "{text}"
    );
    // Without a base the listeners the keys leave out are free ports.
    assert_eq!(ok(SENDER).config.port_table(0)[0], (Listener::Register, 0));
}

#[test]
fn listener_ports_that_collide_or_overflow_are_errors() {
    // The tcp server on the request socket's port.
    expect_problem(
        &RECEIVER
            .replace("transfer_channel: hccl", "transfer_channel: tcp")
            .replace(
                "pd_buffer_device: npu",
                "pd_buffer_device: cpu\npd_data_port: [7400, 7500]",
            ),
        "pd_data_port",
        &["port 7400", "pd_peer_alloc_port"],
    );
    expect_problem(
        &format!("{RECEIVER}pd_base_port: 65530\n"),
        "pd_base_port",
        &["no room", "at most"],
    );
    expect_problem(
        &format!("{RECEIVER}pd_bind_host: \"\"\n"),
        "pd_bind_host",
        &["empty"],
    );
}
