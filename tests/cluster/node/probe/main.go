// Command omni-probe is the whole of the real-node tests' tiny image: a static
// program, built here, that needs nothing from a base image or a registry.
//
//	omni-probe print MSG...   print each MSG on its own line to stdout, exit 0
//	omni-probe serve PORT     answer each TCP connection on PORT with "hello from <hostname>"
//	omni-probe get HOST:PORT  connect, print what the server sends, exit 0 (1 on error)
//	omni-probe whoami         ask the apiserver (in-cluster: the Service's address from the
//	                          environment, the service account's CA and token) who it is
//	omni-probe sleep          wait for SIGTERM, then exit 0
package main

import (
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"
)

const saDir = "/var/run/secrets/kubernetes.io/serviceaccount"

func main() {
	if len(os.Args) < 2 {
		fail("usage: omni-probe print|serve|get|whoami|sleep ...")
	}
	// As pid 1 of a container the kernel drops SIGTERM unless a handler is
	// installed; without one every pod deletion would wait out its grace period.
	term := make(chan os.Signal, 1)
	signal.Notify(term, syscall.SIGTERM, syscall.SIGINT)
	args := os.Args[2:]
	switch os.Args[1] {
	case "print":
		for _, a := range args {
			fmt.Println(a)
		}
	case "serve":
		if len(args) != 1 {
			fail("usage: omni-probe serve PORT")
		}
		serve(args[0], term)
	case "get":
		if len(args) != 1 {
			fail("usage: omni-probe get HOST:PORT")
		}
		get(args[0])
	case "whoami":
		whoami()
	case "sleep":
		fmt.Println("omni-probe: sleeping until SIGTERM")
		<-term
		fmt.Println("omni-probe: got SIGTERM")
	default:
		fail("unknown command " + os.Args[1])
	}
}

func fail(msg string) {
	fmt.Fprintln(os.Stderr, "omni-probe: "+msg)
	os.Exit(1)
}

func serve(port string, term <-chan os.Signal) {
	host, _ := os.Hostname()
	ln, err := net.Listen("tcp", ":"+port)
	if err != nil {
		fail(err.Error())
	}
	fmt.Printf("omni-probe: %s serving on :%s\n", host, port)
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			fmt.Printf("omni-probe: connection from %s\n", conn.RemoteAddr())
			_, _ = fmt.Fprintf(conn, "hello from %s\n", host)
			_ = conn.Close()
		}
	}()
	<-term
	fmt.Println("omni-probe: got SIGTERM")
	_ = ln.Close()
}

func get(addr string) {
	conn, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		fail(err.Error())
	}
	defer func() { _ = conn.Close() }()
	_ = conn.SetDeadline(time.Now().Add(5 * time.Second))
	body, err := io.ReadAll(conn)
	if err != nil {
		fail(err.Error())
	}
	_, _ = os.Stdout.Write(body)
}

// whoami posts a SelfSubjectReview, which every authenticated user may: the
// answer names the pod's service account only if the token was accepted over
// a TLS connection verified against the cluster CA for kubernetes.default.svc.
func whoami() {
	host, port := os.Getenv("KUBERNETES_SERVICE_HOST"), os.Getenv("KUBERNETES_SERVICE_PORT")
	if host == "" || port == "" {
		fail("KUBERNETES_SERVICE_HOST/PORT are not set: not in a pod?")
	}
	caPEM, err := os.ReadFile(saDir + "/ca.crt")
	if err != nil {
		fail(err.Error())
	}
	token, err := os.ReadFile(saDir + "/token")
	if err != nil {
		fail(err.Error())
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(caPEM) {
		fail("no certificate in " + saDir + "/ca.crt")
	}
	client := &http.Client{
		Timeout: 10 * time.Second,
		Transport: &http.Transport{
			Proxy:           nil,
			TLSClientConfig: &tls.Config{RootCAs: pool, ServerName: "kubernetes.default.svc"},
		},
	}
	review := []byte(`{"apiVersion":"authentication.k8s.io/v1","kind":"SelfSubjectReview"}`)
	url := "https://" + net.JoinHostPort(host, port) + "/apis/authentication.k8s.io/v1/selfsubjectreviews"
	req, err := http.NewRequest(http.MethodPost, url, bytes.NewReader(review))
	if err != nil {
		fail(err.Error())
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+string(bytes.TrimSpace(token)))
	resp, err := client.Do(req)
	if err != nil {
		fail(err.Error())
	}
	defer func() { _ = resp.Body.Close() }()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusCreated && resp.StatusCode != http.StatusOK {
		fail(fmt.Sprintf("%s answered %s: %s", url, resp.Status, body))
	}
	var out struct {
		Status struct {
			UserInfo struct {
				Username string `json:"username"`
			} `json:"userInfo"`
		} `json:"status"`
	}
	if err := json.Unmarshal(body, &out); err != nil {
		fail(err.Error())
	}
	fmt.Printf("authenticated as %s\n", out.Status.UserInfo.Username)
}
