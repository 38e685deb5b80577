package main

import (
	"cmp"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/hashicorp/go-sockaddr"

	"github.com/shoal-ai/shoal/cluster"
	"github.com/shoal-ai/shoal/kvcache"
	"github.com/shoal-ai/shoal/scheduler"
)

type clusterFlags struct {
	gossip, advertise, httpAdvertise, key, secret, name, route string
	join                                                       listFlag
	maxQueueWait                                               time.Duration
	tlsCert, tlsKey, tlsCA                                     string
}

func addClusterFlags(fs *flag.FlagSet) *clusterFlags {
	c := &clusterFlags{}
	d := cluster.DefaultConfig()
	fs.StringVar(&c.gossip, "gossip-addr", "", "gossip listen HOST:PORT; setting it joins this node to a cluster")
	fs.StringVar(&c.advertise, "advertise", "", "gossip HOST:PORT other nodes reach (default: --gossip-addr)")
	fs.StringVar(&c.httpAdvertise, "http-advertise", "", "API HOST:PORT other nodes forward to (default: --addr)")
	fs.Var(&c.join, "join", "gossip addresses of nodes to join, comma-separated or repeated")
	fs.StringVar(&c.key, "gossip-key", "", "gossip encryption key, base64 of 16, 24 or 32 bytes; a node with another key never joins")
	fs.StringVar(&c.secret, "cluster-secret", "", "secret that authenticates forwarded requests (default: derived from --gossip-key)")
	fs.StringVar(&c.name, "node-name", "", "unique node name (default: the advertised gossip address)")
	fs.StringVar(&c.route, "route", string(d.Policy), "routing policy: prefix-aware, least-loaded, round-robin, random or prefix-only")
	fs.DurationVar(&c.maxQueueWait, "max-queue-wait", d.MaxQueueWait, "a node whose estimated queue wait exceeds this is saturated; when all are, requests get 429")
	fs.StringVar(&c.tlsCert, "tls-cert", "", "serve the API over TLS with this certificate (PEM)")
	fs.StringVar(&c.tlsKey, "tls-key", "", "private key of --tls-cert (PEM)")
	fs.StringVar(&c.tlsCA, "tls-ca", "", "CA certificate (PEM) that verifies peers' API certificates when forwarding")
	return c
}

// gossipKey decodes --gossip-key.
func (c *clusterFlags) gossipKey() ([]byte, error) {
	if c.key == "" {
		return nil, nil
	}
	k, err := base64.StdEncoding.DecodeString(c.key)
	if err != nil {
		return nil, fmt.Errorf("--gossip-key: not base64: %w", err)
	}
	if len(k) != 16 && len(k) != 24 && len(k) != 32 {
		return nil, fmt.Errorf("--gossip-key: %d bytes, want 16, 24 or 32 (e.g. `head -c 32 /dev/urandom | base64`)", len(k))
	}
	return k, nil
}

// check refuses a gossip key, cluster secret or routing policy that
// startCluster would refuse, before the model loads.
func (c *clusterFlags) check() error {
	key, err := c.gossipKey()
	if err == nil {
		_, err = c.clusterSecret(key)
	}
	if err == nil {
		_, err = cluster.ParsePolicy(c.route)
	}
	return err
}

// clusterSecret is --cluster-secret, or a key derived from the gossip key.
func (c *clusterFlags) clusterSecret(gossipKey []byte) ([]byte, error) {
	if c.secret != "" {
		return []byte(c.secret), nil
	}
	if len(gossipKey) > 0 {
		s := sha256.Sum256(append([]byte("shoal forwarding secret\x00"), gossipKey...))
		return s[:], nil
	}
	return nil, fmt.Errorf("clustering needs --cluster-secret or --gossip-key to authenticate forwarded requests")
}

// clientTLS verifies servers with the CA certificates in file.
func clientTLS(file string) (*tls.Config, error) {
	pem, err := os.ReadFile(file)
	if err != nil {
		return nil, fmt.Errorf("--tls-ca: %w", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("--tls-ca %s: no certificate found", file)
	}
	return &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}, nil
}

// tlsConfigs returns the server's TLS config (nil: plain HTTP) and the forwarder's.
func (c *clusterFlags) tlsConfigs() (server, client *tls.Config, err error) {
	if (c.tlsCert == "") != (c.tlsKey == "") {
		return nil, nil, fmt.Errorf("--tls-cert and --tls-key go together")
	}
	if c.tlsCert != "" {
		cert, err := tls.LoadX509KeyPair(c.tlsCert, c.tlsKey)
		if err != nil {
			return nil, nil, fmt.Errorf("TLS certificate: %w", err)
		}
		server = &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}
	}
	if c.tlsCA != "" {
		if client, err = clientTLS(c.tlsCA); err != nil {
			return nil, nil, err
		}
	} else if server != nil {
		// A node that serves TLS forwards over TLS too, verified with the
		// system's roots, never the client's key in the clear.
		client = &tls.Config{MinVersion: tls.VersionTLS12}
	}
	return server, client, nil
}

// schedulerState adapts the scheduler's snapshots to cluster.LocalState.
type schedulerState struct {
	s          *scheduler.Scheduler
	maxWaiting int
}

func (a schedulerState) Load() cluster.Load {
	l := a.s.Load()
	kv := 0.0
	if l.KVBlocksTotal > 0 {
		kv = float64(l.KVBlocksUsed) / float64(l.KVBlocksTotal)
	}
	sum := a.s.Pool().Summary()
	n := 0
	if sum != nil {
		n = len(sum.Hashes)
	}
	return cluster.Load{Waiting: l.Waiting, Running: l.Running, KVUsed: kv, PrefillTPS: l.PrefillTokensPS, DecodeTPS: l.DecodeTokensPS,
		QueueWaitMS: float64(l.QueueWait) / float64(time.Millisecond), MaxWaiting: a.maxWaiting, SummaryBlocks: n, BlockTokens: l.KVBlockTokens,
		PendingTokens: l.PendingTokens, FinishPS: l.FinishPS}
}

func (a schedulerState) Summary() *kvcache.Summary { return a.s.Pool().Summary() }

func startCluster(cf *clusterFlags, httpAddr, model string, meta cluster.Meta, sc scheduler.Config, sched *scheduler.Scheduler, log *slog.Logger) (*cluster.Node, []byte, error) {
	key, err := cf.gossipKey()
	if err != nil {
		return nil, nil, err
	}
	secret, err := cf.clusterSecret(key)
	if err != nil {
		return nil, nil, err
	}
	policy, err := cluster.ParsePolicy(cf.route)
	if err != nil {
		return nil, nil, err
	}
	// Peers need addresses they can reach: a wildcard listen address (0.0.0.0, ::)
	// is advertised as this machine's private IP, as memberlist itself would (the
	// gossip address already is: resolveAdvertise).
	adv, err := reachable(cmp.Or(cf.httpAdvertise, httpAddr), "--http-advertise")
	if err != nil {
		return nil, nil, err
	}
	if len(key) == 0 {
		log.Warn("gossip is neither encrypted nor authenticated (no --gossip-key): anyone who reaches the gossip port can join and speak for members; use --gossip-key outside a trusted network")
	}
	cc := cluster.DefaultConfig()
	cc.Name, cc.Bind, cc.Advertise, cc.Join, cc.GossipKey, cc.Secret = cf.name, cf.gossip, cf.advertise, cf.join, key, secret
	cc.Policy, cc.MaxQueueWait, cc.BlockTokens, cc.HashSeed = policy, cf.maxQueueWait, sc.KV.BlockTokens, sc.KV.Seed
	cc.Meta = meta
	cc.Meta.HTTP, cc.Meta.Models, cc.Meta.Capacity, cc.Meta.MaxModelLen = adv, append([]string{model}, sc.Adapters...), sc.MaxRunning, sched.MaxContext()
	node, err := cluster.New(cc, schedulerState{s: sched, maxWaiting: sc.MaxWaiting}, log)
	if err != nil {
		return nil, nil, err
	}
	if err := node.Start(); err != nil {
		return nil, nil, err
	}
	msg := "joined cluster"
	if len(node.Members()) < 2 {
		msg = "gossiping, alone so far" // the warning above says why
	}
	log.Info(msg, "node", node.Name(), "gossip", node.GossipAddr(), "route", policy, "peers", len(node.Members())-1)
	return node, secret, nil
}

// checkReachable refuses an API that only this machine can reach (it listens on a
// loopback address, e.g. --addr's default 127.0.0.1:8080, or a name that resolves to
// one) in a cluster whose gossip address other machines reach, unless
// --http-advertise names where peers should forward.
// The gossip address is --advertise as resolveAdvertise left it.
func (c *clusterFlags) checkReachable(bound net.Addr) error {
	if c.httpAdvertise == "" && loopback(bound.String()) && !loopback(c.advertise) {
		return fmt.Errorf("the API listens on %s, which other machines cannot reach, but this node gossips on %s: listen on an address they reach (--addr or --host, e.g. --host 0.0.0.0) or set --http-advertise", bound, c.advertise)
	}
	return nil
}

// resolveAdvertise sets --advertise, once, to the gossip address peers reach:
// --advertise or --gossip-addr, a wildcard host replaced by this machine's private IP.
func (c *clusterFlags) resolveAdvertise() error {
	adv, err := reachable(cmp.Or(c.advertise, c.gossip), "--advertise")
	c.advertise = adv
	return err
}

// loopback reports whether addr's host is a loopback address or localhost.
func loopback(addr string) bool {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return false
	}
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// setWithoutGossip lists the cluster flags given on the command line or in the
// environment, which do nothing without --gossip-addr.
func (c *clusterFlags) setWithoutGossip(fs *flag.FlagSet) []string {
	var set []string
	fs.Visit(func(f *flag.Flag) {
		switch f.Name {
		case "join", "gossip-key", "cluster-secret", "tls-ca", "advertise", "http-advertise", "node-name", "route", "max-queue-wait":
			set = append(set, "--"+f.Name)
		}
	})
	return set
}

// reachable returns addr with a wildcard or empty host replaced by this machine's
// private IP (the one memberlist would pick); flag names what to set when it has
// none.
func reachable(addr, flag string) (string, error) {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return "", fmt.Errorf("address %q: %w", addr, err)
	}
	if ip := net.ParseIP(host); host != "" && (ip == nil || !ip.IsUnspecified()) {
		return addr, nil
	}
	private, err := sockaddr.GetPrivateIP()
	if err != nil || private == "" {
		return "", fmt.Errorf("%s listens on every interface and this machine has no private IP to advertise: set %s HOST:PORT, the address other nodes reach it at", addr, flag)
	}
	return net.JoinHostPort(private, port), nil
}

func runStatus(args []string, stdout, _ io.Writer) error {
	fs := newFlags("status", stdout)
	addr := fs.String("addr", "127.0.0.1:8080", "API address of any node, HOST:PORT or a URL")
	key := fs.String("api-key", os.Getenv("SHOAL_API_KEY"), "bearer key, if the node requires one")
	ca := fs.String("tls-ca", "", "CA certificate (PEM) to verify a node serving TLS with (implies https)")
	if err := parse(fs, args); err != nil {
		return err
	}
	url := *addr
	client := &http.Client{Timeout: 10 * time.Second}
	if *ca != "" {
		conf, err := clientTLS(*ca)
		if err != nil {
			return err
		}
		client.Transport = &http.Transport{TLSClientConfig: conf}
		if !strings.Contains(url, "://") {
			url = "https://" + url
		}
	}
	if !strings.Contains(url, "://") {
		url = "http://" + url
	}
	if err := checkURL(url); err != nil {
		return fmt.Errorf("--addr: %w", err)
	}
	// The API's base URL, as clients and bench are given it, names the node too.
	base := strings.TrimSuffix(strings.TrimSuffix(url, "/"), "/v1")
	req, err := http.NewRequest("GET", base+"/cluster", nil)
	if err != nil {
		return fmt.Errorf("--addr: %w", err)
	}
	if *key != "" {
		req.Header.Set("Authorization", "Bearer "+*key)
	}
	resp, err := client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		var e struct {
			Error struct {
				Message string `json:"message"`
			} `json:"error"`
		}
		msg := strings.TrimSpace(string(b))
		if json.Unmarshal(b, &e) == nil && e.Error.Message != "" {
			msg = e.Error.Message // the refusal's text, not its JSON
		}
		return fmt.Errorf("GET /cluster: status %d: %s", resp.StatusCode, msg)
	}
	var info struct {
		Self    string           `json:"self"`
		Members []cluster.Member `json:"members"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&info); err != nil {
		return fmt.Errorf("GET /cluster: %w", err)
	}
	tw := tabwriter.NewWriter(stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "NODE\tADDR\tSTATE\tMODELS\tDEVICE\tWAITING\tRUNNING\tKV\tPREFILL TOK/S\tDECODE TOK/S\tFINISHED/S\tQUEUE WAIT\tPREFIX BLOCKS\tUPDATED")
	for _, m := range info.Members {
		name := m.Name
		if name == info.Self {
			name += " (self)"
		}
		state := m.State
		if m.Draining {
			state += ",draining"
		}
		if m.Simulated {
			state += ",SIMULATED"
		}
		load := fmt.Sprintf("%d\t%d\t%.0f%%\t%.0f\t%.0f\t%.1f\t%.0fms\t%d", m.Load.Waiting, m.Load.Running, 100*m.Load.KVUsed,
			m.Load.PrefillTPS, m.Load.DecodeTPS, m.Load.FinishPS, m.Load.QueueWaitMS, m.SummaryBlocks)
		if m.State == "dead" || m.State == "left" {
			load = strings.Repeat("-\t", 7) + "-" // its last load is not its load now
		}
		models := strings.Join(m.Models, ",")
		if len(m.Aliases) > 0 {
			models += " (alias " + strings.Join(m.Aliases, ",") + ")" // other ids of its first model
		}
		if m.Task != "" {
			models += " (" + m.Task + ")" // served to embed or to rerank, not to generate
		} else if m.Vision {
			models += " (vision)"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%dms ago\n", name, m.Addr, state, models, cmp.Or(m.Device, "-"), load, m.UpdatedAgoMS)
	}
	return tw.Flush()
}
