// A Go crypto/tls client's first flight: go run go_client.go PORT NAME.
package main

import (
	"crypto/tls"
	"os"
)

func main() {
	conn, err := tls.Dial("tcp", "127.0.0.1:"+os.Args[1], &tls.Config{ServerName: os.Args[2], InsecureSkipVerify: true})
	if err == nil {
		conn.Close()
	}
}
