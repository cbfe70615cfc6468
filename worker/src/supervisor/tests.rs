use super::*;

fn config() -> PoolConfig {
    PoolConfig {
        tenant: "acme".into(),
        program: "/bin/false".into(),
        args: vec!["app-server".into()],
        codex_home: "/tmp/cf/home".into(),
        cwd: "/tmp/cf/cwd".into(),
        socket_dir: "/tmp/cf/s".into(),
        thread_unload_delay_secs: 1800,
        config_overrides: vec!["model=\"m\"".into()],
        env: vec![("SECRET".into(), "hunter2".into())],
        min_workers: 0,
        max_workers: 1,
        ready_timeout: Duration::from_secs(5),
        health_interval: Duration::from_secs(5),
        health_timeout: Duration::from_secs(2),
        restart_backoff_initial: Duration::from_millis(100),
        restart_backoff_max: Duration::from_secs(5),
        stop_grace: Duration::from_secs(5),
        ..PoolConfig::default()
    }
}

#[test]
fn valid_config_passes() {
    config().validate().unwrap();
}

#[test]
fn invalid_configs_are_named() {
    let mut c = config();
    c.tenant = "a/b".into();
    assert!(matches!(c.validate(), Err(ConfigError::InvalidTenant(_))));
    let mut c = config();
    c.min_workers = 2;
    assert!(matches!(c.validate(), Err(ConfigError::Caps { .. })));
    let mut c = config();
    c.max_workers = 0;
    assert!(matches!(c.validate(), Err(ConfigError::Caps { .. })));
    let mut c = config();
    c.cwd = "rel".into();
    assert_eq!(c.validate(), Err(ConfigError::RelativePath("cwd")));
    let mut c = config();
    c.socket_dir = PathBuf::from("/tmp").join("d".repeat(90));
    let err = c.validate().unwrap_err();
    assert!(
        matches!(err, ConfigError::SocketPathTooLong { .. }),
        "{err}"
    );
    assert!(err.to_string().contains("shorter"), "{err}");
    let mut c = config();
    c.health_timeout = Duration::ZERO;
    assert_eq!(
        c.validate(),
        Err(ConfigError::ZeroDuration("health_timeout"))
    );
}

#[test]
fn worker_args_append_listen_and_overrides() {
    let c = config();
    let args = c.worker_args(&c.socket_path(0));
    let args: Vec<_> = args.iter().map(|a| a.to_str().unwrap()).collect();
    assert_eq!(
        args,
        [
            "app-server",
            "--listen",
            "unix:///tmp/cf/s/acme/0.sock",
            "-c",
            "thread_unload_delay_secs=1800",
            "-c",
            "model=\"m\"",
        ]
    );
}

#[test]
fn debug_hides_env_values() {
    let text = format!("{:?}", config());
    assert!(text.contains("SECRET"));
    assert!(!text.contains("hunter2"));
}

#[tokio::test]
async fn invalid_config_fails_acquire_without_starting() {
    let mut c = config();
    c.tenant = String::new();
    let pool = Pool::new(
        c,
        WorkerMetrics::register(&prometheus::Registry::new()).unwrap(),
    );
    assert!(matches!(
        pool.acquire().await,
        Err(PoolError::Config { .. })
    ));
    assert!(pool.workers().is_empty());
}

#[tokio::test]
async fn acquire_after_shutdown_fails() {
    let pool = Pool::new(
        config(),
        WorkerMetrics::register(&prometheus::Registry::new()).unwrap(),
    );
    pool.shutdown(Duration::from_millis(10)).await;
    pool.shutdown(Duration::from_millis(10)).await;
    assert!(matches!(
        pool.acquire().await,
        Err(PoolError::ShuttingDown { .. })
    ));
}
